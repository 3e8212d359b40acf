"""Issue 31: a tenant's pool-wide concurrency cap (max_concurrent), taken at claim time.

Two in-process workers on the fake engine: the capped tenant never has more jobs in the
engines than its cap (sampled every few milliseconds, well under a step), an uncapped tenant
runs beside it. Then worker processes: one SIGKILLed while holding the tenant's slots leaks
none of them (they lapse, its jobs are taken over and finish)."""
from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import ExitStack

from genpool.producer.keys_store import KeyStore
from genpool.schemas.tenant_records import TenantLimits
from genpool.schemas.tenants import TenantKeys
from tests.fake_engine import FakeEngine
from tests.pool_helpers import client_env, spawn_worker, stop_proc, wait_for, worker_thread, workers_alive


def running_of(engines: list[FakeEngine], prefix: str) -> int:
    while True:
        try:
            return sum(rid.startswith(prefix) for e in engines for rid in list(e.requests))
        except RuntimeError:  # the dict changed under the copy: look again
            continue


def test_the_cap_is_never_exceeded_and_others_run_beside(redis_url):
    with client_env(redis_url, "caps") as (url, prefix, c):
        KeyStore(c.redis, c.keys).set_limits("acme", TenantLimits(max_concurrent=3))
        engines = [FakeEngine(max_num_seqs=8, step_delay=0.01) for _ in range(2)]
        seen, stop = [], threading.Event()

        def sample():
            while not stop.is_set():
                seen.append(running_of(engines, "acme-"))
                time.sleep(0.002)

        with ExitStack() as stack:
            for e in engines:
                stack.enter_context(worker_thread(e, url, prefix))
            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            capped = c.submit_many([{"prompt": f"a{i}", "max_tokens": 10, "tenant": "acme",
                                     "job_id": f"acme-{i}"} for i in range(20)])
            free = c.submit_many([{"prompt": f"b{i}", "max_tokens": 10, "tenant": "beta",
                                   "job_id": f"beta-{i}"} for i in range(10)])
            running = TenantKeys(c.keys).running("acme")
            for j in capped + free:
                assert j.result(timeout=60).ok
            stop.set()
            sampler.join(5)
            wait_for(lambda: c.redis.zcard(running) == 0, 10, what="slots freed")
        assert max(seen) == 3, max(seen)  # reached, never passed


def test_a_killed_worker_leaks_no_slots(redis_url, tmp_path):
    common = ("--engine-factory", "tests.fake_engine:make", "--max-num-seqs", "8",
              "--claim-idle-ms", "800", "--heartbeat-s", "0.2")
    fast = {"GENPOOL_FAKE_STEP_DELAY": "0.02"}
    with client_env(redis_url, "capkill") as (url, prefix, c):
        KeyStore(c.redis, c.keys).set_limits("acme", TenantLimits(max_concurrent=2))
        running = TenantKeys(c.keys).running("acme")
        a = spawn_worker(url, prefix, "fake", "doomed", *common, env=fast,
                         log_path=tmp_path / "a.log")
        b = None
        try:
            wait_for(lambda: workers_alive(url, prefix) == 1, timeout=60, what="worker a up")
            jobs = c.submit_many([{"prompt": f"k{i}", "max_tokens": 60, "tenant": "acme"}
                                  for i in range(4)])
            wait_for(lambda: c.redis.zcard(running) == 2, 30, what="a holds 2 slots")
            os.kill(a.pid, signal.SIGKILL)
            a.wait(10)
            b = spawn_worker(url, prefix, "fake", "rescuer", *common, env=fast,
                             log_path=tmp_path / "b.log")
            for j in jobs:
                assert j.result(timeout=90).ok
            wait_for(lambda: c.redis.zcard(running) == 0, 10, what="every slot freed")
        finally:
            stop_proc(a, 5)
            if b is not None:
                stop_proc(b, 20)


def test_a_lost_running_set_is_rebuilt_by_the_renewals(redis_url):
    """A Redis restart without persistence loses the set: the held slots come back with the
    next renewal (until then new claims see fewer slots taken: the cap can be passed for that
    moment, which persistence, AOF or RDB, avoids)."""
    with client_env(redis_url, "caplost") as (url, prefix, c):
        KeyStore(c.redis, c.keys).set_limits("acme", TenantLimits(max_concurrent=2))
        running = TenantKeys(c.keys).running("acme")
        with worker_thread(FakeEngine(max_num_seqs=8, step_delay=0.01), url, prefix,
                           heartbeat_s=0.2):
            jobs = c.submit_many([{"prompt": f"l{i}", "max_tokens": 150, "tenant": "acme"}
                                  for i in range(2)])
            wait_for(lambda: c.redis.zcard(running) == 2, 10, what="2 slots taken")
            c.redis.delete(running)
            wait_for(lambda: c.redis.zcard(running) == 2, 5, what="the held slots put back")
            assert c.redis.pttl(running) > 0
            for j in jobs:
                assert j.result(timeout=60).ok


def test_jobs_held_at_a_tenants_cap_leave_the_worker_free_for_others(redis_url):
    """A worker's first read can take many entries of a capped tenant before it learns the
    tenant is full. Held for the cap, they are not running: counted as taken slots, they kept
    the worker from pulling other tenants' jobs, which came in one at a time as the capped
    tenant's jobs ended. Another tenant's jobs now run side by side beside the backlog."""
    with client_env(redis_url, "capheld") as (url, prefix, c):
        KeyStore(c.redis, c.keys).set_limits("acme", TenantLimits(max_concurrent=1))
        engine = FakeEngine(max_num_seqs=8, step_delay=0.01)
        # queued before the worker starts: its first read takes a slot's worth of them at once
        backlog = c.submit_many([{"prompt": f"a{i}", "max_tokens": 60, "tenant": "acme",
                                  "job_id": f"acme-{i}"} for i in range(10)])
        seen, stop = [], threading.Event()

        def sample():
            while not stop.is_set():
                seen.append(running_of([engine], "beta-"))
                time.sleep(0.002)
        with worker_thread(engine, url, prefix):
            wait_for(lambda: running_of([engine], "acme-") == 1, 30, what="acme running")
            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            others = c.submit_many([{"prompt": f"b{i}", "max_tokens": 30, "tenant": "beta",
                                     "job_id": f"beta-{i}"} for i in range(6)])
            for j in others:
                assert j.result(timeout=60).ok
            stop.set()
            sampler.join(5)
            for j in backlog:
                assert j.result(timeout=120).ok
        assert max(seen) >= 4, max(seen)  # side by side (one at a time before)
