"""Issue 31, fair pull: a worker SIGKILLed while it holds tenants' jobs (entries pending on
their sub-streams) loses nobody's place: another worker reclaims them from the sub-streams and
every job ends with exactly one result. Real worker processes on the fake engine."""
from __future__ import annotations

import os
import signal

from tests.chaos_helpers import pool_problems
from tests.fake_engine import expected_for_prompt
from tests.pool_helpers import client_env, spawn_worker, stop_proc, wait_for, workers_alive

COMMON = ("--engine-factory", "tests.fake_engine:make", "--max-num-seqs", "8",
          "--claim-idle-ms", "800", "--heartbeat-s", "0.2")
FAST = {"GENPOOL_FAKE_STEP_DELAY": "0.02"}


def test_a_killed_workers_tenant_jobs_are_taken_over_from_their_sub_streams(redis_url, tmp_path):
    with client_env(redis_url, "fairkill") as (url, prefix, c):
        a = spawn_worker(url, prefix, "fake", "doomed", *COMMON, env=FAST,
                         log_path=tmp_path / "a.log")
        b = None
        try:
            wait_for(lambda: workers_alive(url, prefix) == 1, timeout=60, what="worker a up")
            jobs = c.submit_many([dict(prompt=f"held {i}", max_tokens=80,
                                       tenant=("acme", "beta")[i % 2]) for i in range(8)])
            wait_for(lambda: all(c.redis.exists(c.keys.events(j.id)) for j in jobs), timeout=30,
                     what="a streaming all 8")
            os.kill(a.pid, signal.SIGKILL)
            a.wait(10)
            b = spawn_worker(url, prefix, "fake", "rescuer", *COMMON, env=FAST,
                             log_path=tmp_path / "b.log")
            for i, j in enumerate(jobs):
                res = j.result(timeout=90)
                assert res.text == expected_for_prompt(f"held {i}", 80)
                assert res.worker == "rescuer"
        finally:
            stop_proc(a, 5)
            if b is not None:
                stop_proc(b, 20)
        assert pool_problems(c, jobs) == {}
