"""Issue 31's fairness measurements, on fake engines (no model): one run each.

1. The flood: tenants A and C queue --flood jobs each at once (504 estimated tokens apiece), B
   sends --trickle jobs at a steady rate; B's p50 / p99 queue time (claim minus submit) with
   fair pull, without it (every job the default tenant's: arrival order), and B alone. Jain's
   index over the tokens A and C were served while both were backlogged.
2. The cost of fair pull: --jobs short jobs from --tenants tenants (fair) vs the same jobs as
   one default tenant, through --workers in-process workers with no step delay: jobs per second
   and token events per second.

    python benchmarks/tenant_flood.py --redis redis://127.0.0.1:6379/9
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(ROOT)

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from contextlib import ExitStack  # noqa: E402

from genpool.producer import Client  # noqa: E402
from genpool.schemas.tenants import DEFAULT_TENANT  # noqa: E402
from tests.fake_engine import FakeEngine  # noqa: E402
from tests.pool_helpers import drop_prefix, new_prefix, worker_thread  # noqa: E402
from tests.tenant_flood import Flood, run  # noqa: E402


def throughput(url: str, fair: bool, jobs: int, tenants: int, workers: int,
               max_tokens: int) -> dict:
    prefix = new_prefix("tput")
    c = Client(url, prefix)
    try:
        with ExitStack() as stack:
            for _ in range(workers):
                stack.enter_context(worker_thread(FakeEngine(max_num_seqs=16), url, prefix))
            t0 = time.perf_counter()
            handles = c.submit_many([{
                "prompt": f"job {i}", "max_tokens": max_tokens,
                "tenant": f"t{i % tenants}" if fair else DEFAULT_TENANT} for i in range(jobs)])
            for h in handles:
                h.result(timeout=600)
            wall = time.perf_counter() - t0
        return {"fair": fair, "jobs_per_s": jobs / wall, "token_events_per_s":
                jobs * max_tokens / wall, "wall_s": wall}
    finally:
        c.close()
        drop_prefix(url, prefix)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/9")
    ap.add_argument("--flood", type=int, default=1000, help="jobs each of A and C queue")
    ap.add_argument("--trickle", type=int, default=20, help="B's jobs, one per --every")
    ap.add_argument("--every", type=float, default=0.05, help="seconds between B's jobs")
    ap.add_argument("--jobs", type=int, default=2000, help="throughput run: jobs")
    ap.add_argument("--tenants", type=int, default=50, help="throughput run: tenants")
    ap.add_argument("--workers", type=int, default=2, help="throughput run: workers")
    a = ap.parse_args()
    f = dict(flood_jobs=a.flood, trickle_jobs=a.trickle, trickle_every_s=a.every)
    rows = {"fair": run(a.redis, Flood(fair=True, **f)),
            "unfair": run(a.redis, Flood(fair=False, **f)),
            "b_alone": run(a.redis, Flood(fair=True, **f), trickle_alone=True)}
    for fair in (False, True):
        rows[f"throughput_{'fair' if fair else 'unfair'}"] = throughput(
            a.redis, fair, a.jobs, a.tenants, a.workers, 8)
    print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
