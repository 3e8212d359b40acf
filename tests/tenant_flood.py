"""Issue 31's flood, small: tenants A and C each submit a backlog at once, tenant B submits a
few jobs at a steady rate; in-process workers on the fake engine run them all. With fair pull
each tenant queues on its own sub-stream; without it (`fair=False`) every job goes on the lane
stream as the default tenant, as before tenants (arrival order). Shared by
tests/tenants/test_fair_flood.py and benchmarks/tenant_flood.py."""
from __future__ import annotations

import statistics
import time
from contextlib import ExitStack
from dataclasses import dataclass

from genpool.producer import Client
from genpool.schemas.tenants import DEFAULT_TENANT
from tests.fake_engine import FakeEngine
from tests.pool_helpers import drop_prefix, new_prefix, worker_thread

FLOOD_PROMPT = "x" * 2000  # 500 estimated tokens + max_tokens 4: a 504-token job
TRICKLE_PROMPT = "hello"


@dataclass
class Flood:
    flood_jobs: int = 150  # each of A and C
    trickle_jobs: int = 10  # B
    trickle_every_s: float = 0.05
    workers: int = 1
    slots: int = 4
    step_delay_s: float = 0.002
    fair: bool = True


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if any(xs) else 1.0


def run(url: str, f: Flood, trickle_alone: bool = False) -> dict:
    """B's queue times (p50, p99, s) and, among A and C while both were backlogged, the tokens
    each was served and Jain's index over them."""
    prefix = new_prefix("flood")
    tenant = (lambda t: t) if f.fair else (lambda t: DEFAULT_TENANT)
    c = Client(url, prefix)
    try:
        with ExitStack() as stack:
            for _ in range(f.workers):
                stack.enter_context(worker_thread(FakeEngine(max_num_seqs=f.slots,
                                                             step_delay=f.step_delay_s),
                                                  url, prefix))
            floods = [] if trickle_alone else [
                c.submit_many([{"prompt": FLOOD_PROMPT, "max_tokens": 4, "tenant": tenant(t),
                                "job_id": f"{t}-{i}"} for i in range(f.flood_jobs)])
                for t in ("a", "c")]
            trickle = []
            for i in range(f.trickle_jobs):
                trickle.append(c.submit(TRICKLE_PROMPT, max_tokens=4, tenant=tenant("b"),
                                        job_id=f"b-{i}"))
                time.sleep(f.trickle_every_s)
            for job in [*trickle, *(j for jobs in floods for j in jobs)]:
                job.result(timeout=300)
        return _measure(c, f, trickle, floods)
    finally:
        c.close()
        drop_prefix(url, prefix)


def _times(c: Client, job_id: str) -> tuple[float, float]:
    sub, start = c.redis.hmget(c.keys.job(job_id), "submitted_at", "started_at")
    return float(sub), float(start)


def _measure(c: Client, f: Flood, trickle: list, floods: list) -> dict:
    waits = [start - sub for sub, start in (_times(c, j.id) for j in trickle)]
    out = {"b_p50_s": statistics.median(waits), "b_p99_s": _pct(waits, 0.99)}
    if floods:
        started = sorted((_times(c, j.id)[1], j.id.split("-")[0]) for jobs in floods for j in jobs)
        last = {t: max(s for s, who in started if who == t) for t in ("a", "c")}
        both_until = min(last.values())  # after it only one of them is backlogged
        served = {t: 504 * sum(1 for s, who in started if who == t and s <= both_until)
                  for t in ("a", "c")}
        out.update(tokens_a=served["a"], tokens_c=served["c"],
                   jain=jain([served["a"], served["c"]]))
    return out
