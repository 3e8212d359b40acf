"""Issue 16's load case: many ordinary jobs on real workers while the CPU is oversubscribed.

    python benchmarks/load_exactly_once.py [--jobs 1000] [--workers 2] [--burners 4]
                                           [--claim-idle-ms 10000] [--model smollm2-135m]

The report that opened issue 16: under heavy CPU load with --claim-idle-ms 10000, 122 of 1,000
ordinary jobs ran twice (a blocked loop let another worker reclaim live jobs). This starts N real
`genpool worker` processes on the real model, `--burners` busy-loop processes to oversubscribe the
cores, submits the jobs, and checks every job's raw event stream: exactly one terminal event, the
last one, and no two attempts' tokens interleaved (tests/chaos_helpers.py's rules). It prints one
row for docs/results.md. Needs Redis (GENPOOL_REDIS_URL or 127.0.0.1:6379/9); its own key prefix,
deleted at the end.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))

from genpool.producer import Client  # noqa: E402
from genpool.schemas.connection import delete_prefix  # noqa: E402
from tests.chaos_helpers import pool_problems, raw_events  # noqa: E402

PROMPTS = ["Name a fruit.", "Say hello to Ada.", "What is 2 + 2?", "Give one color.",
           "Name a planet.", "Write one word about the sea."]


def start_workers(args, url: str, prefix: str, first: int = 0, n=None) -> list[subprocess.Popen]:
    procs = []
    for i in range(first, first + (args.workers if n is None else n)):
        cmd = [sys.executable, "-P", "-m", "genpool.workers.cli.main", "worker", "--model", args.model, "--redis", url,
               "--prefix", prefix, "--name", f"load-{i}", "--claim-idle-ms", str(args.claim_idle_ms),
               "--max-num-seqs", "32", "--num-threads", "1", "--kv-cache-memory", str(256 << 20)]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
                                      stderr=open(f"/tmp/{prefix}-w{i}.log", "wb"), start_new_session=True))
    return procs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=1000, help="ordinary jobs to submit (default 1000)")
    ap.add_argument("--workers", type=int, default=2, help="real worker processes (default 2)")
    ap.add_argument("--burners", type=int, default=4, help="busy-loop processes for load (default 4)")
    ap.add_argument("--claim-idle-ms", type=int, default=10_000, help="workers' claim window (default 10000)")
    ap.add_argument("--max-tokens", type=int, default=12, help="tokens per job (default 12)")
    ap.add_argument("--model", default="smollm2-135m", help="model (default smollm2-135m)")
    ap.add_argument("--timeout-s", type=float, default=1800, help="give up after (default 1800)")
    ap.add_argument("--sigkill-at", type=float, default=None,
                    help="SIGKILL worker 0 once this fraction of the jobs has ended, and start a "
                         "replacement (default: none: no kill)")
    args = ap.parse_args()
    url = os.environ.get("GENPOOL_REDIS_URL", "redis://127.0.0.1:6379/9")
    prefix = f"load-{uuid.uuid4().hex[:8]}"
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.burners)]
    procs = start_workers(args, url, prefix)
    c = Client(url, prefix)
    t0 = time.time()
    try:
        jobs = [c.submit(PROMPTS[i % len(PROMPTS)], max_tokens=args.max_tokens, temperature=0.8,
                         seed=i) for i in range(args.jobs)]
        for k, j in enumerate(jobs):
            if args.sigkill_at is not None and k == int(args.sigkill_at * len(jobs)):
                procs[0].kill()  # mid-run: its jobs are reclaimed by the others
                procs += start_workers(args, url, prefix, first=args.workers, n=1)
            try:
                j.result(timeout=max(1.0, args.timeout_s - (time.time() - t0)), raise_on_error=False)
            except TimeoutError:
                pass  # counted below as lost (no terminal event)
        wall = time.time() - t0
        problems = pool_problems(c, jobs)
        streams = {j.id: raw_events(c, j.id) for j in jobs}
        terminals = [sum(e.type in ("result", "error") for e in evs) for evs in streams.values()]
        restarted = sum(any(e.type == "restart" for e in evs) for evs in streams.values())
        lost, dup = terminals.count(0), sum(n > 1 for n in terminals)
        interleaved = sum(any("after attempt" in x for x in v) for k, v in problems.items() if k != "lanes")
        deaths = sum(p.poll() is not None for p in procs) - (args.sigkill_at is not None)
        kill = f", worker 0 SIGKILLed at {args.sigkill_at:.0%} and replaced" if args.sigkill_at else ""
        print(f"| {args.jobs} ordinary jobs, {args.workers} SmolLM2 workers, {args.burners} busy-loop "
              f"processes on {os.cpu_count()} cores, --claim-idle-ms {args.claim_idle_ms}, "
              f"{args.max_tokens} tokens each{kill} | {args.jobs} | "
              f"{restarted} | {lost} | {dup} | {1 if 'lanes' in problems else 0} | {deaths} |")
        print(f"wall {wall:.0f} s; interleaved attempts: {interleaved}; jobs with any problem: "
              f"{len(problems)}")
        for k, v in list(problems.items())[:10]:
            print("  ", k, v)
    finally:
        for p in procs + burners:
            p.kill()
        for p in procs + burners:
            p.wait()
        delete_prefix(c.redis, prefix)


if __name__ == "__main__":
    main()
