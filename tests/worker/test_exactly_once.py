"""Issue 16's three defects, reproduced, plus crash attribution and a stopped worker.

1. A poisoned request (repetition_penalty=1e-45) reached the engine and killed workers in turn.
2. A worker whose loop blocked longer than --claim-idle-ms had its live jobs taken over: two
   results per job, interleaved tokens.
3. Job ids with ':' could name another job's keys (`v:events` is job `v`'s event stream).
Real Redis throughout; the fake engine where only the queue's behaviour matters.
"""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.chaos_helpers import pool_problems, raw_events, stream_problems
from tests.fake_engine import FakeEngine, expected_for_prompt
from tests.pool_helpers import client_env, spawn_worker, stop_proc, wait_for, worker_thread, workers_alive


@pytest.fixture
def env(redis_url):
    with client_env(redis_url, "once") as e:
        yield e


# -- 3: keys that cannot collide -------------------------------------------------------------
def test_job_ids_cannot_name_another_jobs_keys(env):
    url, prefix, c = env
    with pytest.raises(ValueError, match="id"):
        c.submit("Hello", job_id="v:events", max_tokens=3)
    with pytest.raises(ValueError, match="id"):
        c.submit("Hello", job_id="{v}", max_tokens=3)
    c.redis.xadd(c.keys.jobs("normal"), {"job": json.dumps({"id": "v:events", "prompt": "x"})})
    job = c.submit("Hello", job_id="v", max_tokens=3)
    with worker_thread(FakeEngine(), url, prefix):
        assert job.result(timeout=10).text == expected_for_prompt("Hello", 3)
        wait_for(lambda: c.redis.xlen(c.keys.dead) == 1, what="the bad id dead-lettered")
    assert c.keys.events("v") == f"{prefix}:job:{{v}}:events"  # one hash tag for both keys
    assert c.redis.type(c.keys.job("v")) == "hash"


# -- 1: a poisoned request fails alone -------------------------------------------------------
def test_poisoned_repetition_penalty_is_refused_at_every_door(env):
    url, prefix, c = env
    with pytest.raises(ValueError, match="repetition_penalty"):
        c.submit("Tell me a joke", max_tokens=8, temperature=1.0, repetition_penalty=1e-45)
    raw = {"id": "poison", "prompt": "Tell me a joke", "max_tokens": 8, "temperature": 1.0,
           "repetition_penalty": 1e-45}
    c.redis.xadd(c.keys.jobs("normal"), {"job": json.dumps(raw)})
    c.redis.xadd(c.keys.jobs("normal"), {"job": json.dumps(dict(raw, id="nan", temperature=1.0,
                                                               repetition_penalty=float("nan")))})
    good = c.submit("Tell me a joke", max_tokens=8)
    with worker_thread(FakeEngine(), url, prefix) as w:
        for jid in ("poison", "nan"):
            err = c.job(jid).result(timeout=10, raise_on_error=False).error
            assert err.code == "invalid_request" and "repetition_penalty" in err.message
        assert good.result(timeout=10).text == expected_for_prompt("Tell me a joke", 8)
        assert not w.stopping and w.counts["failed"] == 0


# -- 2: a blocked loop keeps its jobs --------------------------------------------------------
class StallOnce(FakeEngine):
    """Blocks its loop once, for longer than the claim window (as a megabyte of chat template or
    a swapped-out host would)."""

    def __init__(self, stall_at: int, stall_s: float, **kw):
        super().__init__(**kw)
        self.stall_at, self.stall_s = stall_at, stall_s

    def step(self):
        if self.step_count == self.stall_at:
            time.sleep(self.stall_s)
        return super().step()


def test_a_blocked_loop_does_not_lose_its_live_jobs(env):
    url, prefix, c = env
    slow = StallOnce(stall_at=5, stall_s=2.5, max_num_seqs=8, step_delay=0.01)
    jobs = c.submit_many([dict(prompt=f"live {i}", max_tokens=40) for i in range(8)])
    # claim window 1.0 s, refreshed every 0.1 s: a CI stall of the lease thread (0.7 s seen)
    # fits, while the 2.5 s stall of a loop that kept the entries itself would not
    with worker_thread(slow, url, prefix, claim_idle_ms=1000, heartbeat_s=0.1,
                       name="blocked") as a:
        wait_for(lambda: len(a.jobs.running) == 8, what="8 jobs running")
        with worker_thread(FakeEngine(), url, prefix, claim_idle_ms=1000, heartbeat_s=0.1,
                           name="other"):
            for i, job in enumerate(jobs):
                res = job.result(timeout=30)
                assert res.text == expected_for_prompt(f"live {i}", 40) and res.worker == "blocked"
    for job in jobs:
        events = raw_events(c, job.id)
        assert "restart" not in [e.type for e in events], job.id
        assert stream_problems(c, job.id) == [], job.id
        assert job.info()["worker"] == "blocked" and job.info()["attempts"] == "1"
    assert a.timing["engine_s"] >= 2.5  # the stall really happened, in the loop


# -- crash attribution ------------------------------------------------------------------------
def test_a_crashing_job_is_dead_lettered_alone(env, tmp_path):
    """A job that kills every worker that runs it (SIGSEGV) is dead-lettered after
    --max-deliveries solo runs; the jobs that shared its first batch all finish."""
    url, prefix, c = env
    innocents = c.submit_many([dict(prompt=f"bystander {i}", max_tokens=20) for i in range(5)])
    poison = c.submit("POISON pill", max_tokens=20)
    procs, deaths = [], 0

    def supervise():  # what compose's `restart: unless-stopped` does
        nonlocal deaths
        if not procs or procs[-1].poll() is not None:
            deaths += bool(procs)
            procs.append(spawn_worker(url, prefix, "fake", f"crash-{len(procs)}",
                                      "--engine-factory", "tests.fake_engine:make_crashing",
                                      "--max-num-seqs", "8", "--claim-idle-ms", "700",
                                      "--max-deliveries", "2", "--heartbeat-s", "0.2",
                                      env={"GENPOOL_FAKE_STEP_DELAY": "0.01"},
                                      log_path=tmp_path / f"w{len(procs)}.log"))
        return poison.info().get("state") == "dead" and all(
            j.info().get("state") == "done" for j in innocents)

    try:
        wait_for(supervise, timeout=120, interval=0.2, what="poison dead, bystanders done")
    finally:
        for p in procs:
            stop_proc(p, 10)
    err = poison.result(timeout=5, raise_on_error=False).error
    assert err.code == "dead_lettered" and "alone" in err.message
    for i, j in enumerate(innocents):
        assert j.result(timeout=5).text == expected_for_prompt(f"bystander {i}", 20)
    dead = c.redis.xrange(c.keys.dead)
    assert [f["job_id"] for _, f in dead] == [poison.id]
    # two shared batches (uncharged: a single loss runs its jobs batched again), then two solo
    # runs (charged; max-deliveries 2)
    assert deaths == 4
    assert pool_problems(c, [*innocents, poison]) == {}


# -- a worker stopped past its lease, then resumed ---------------------------------------------
def test_sigstopped_worker_cannot_write_after_it_was_replaced(env, tmp_path):
    url, prefix, c = env
    common = ("--engine-factory", "tests.fake_engine:make", "--max-num-seqs", "8",
              "--claim-idle-ms", "800", "--heartbeat-s", "0.2")
    fast = {"GENPOOL_FAKE_STEP_DELAY": "0.02"}
    a = spawn_worker(url, prefix, "fake", "stopped", *common, env=fast,
                     log_path=tmp_path / "a.log")
    b = None
    try:
        wait_for(lambda: workers_alive(url, prefix) == 1, timeout=60, what="worker a up")
        jobs = c.submit_many([dict(prompt=f"held {i}", max_tokens=120) for i in range(8)])
        wait_for(lambda: all(c.redis.exists(c.keys.events(j.id)) for j in jobs), timeout=30,
                 what="a streaming all 8")
        os.kill(a.pid, signal.SIGSTOP)
        b = spawn_worker(url, prefix, "fake", "rescuer", *common, env=fast,
                         log_path=tmp_path / "b.log")
        wait_for(lambda: all(j.info().get("worker") == "rescuer" for j in jobs), timeout=60,
                 what="b took every job over")
        os.kill(a.pid, signal.SIGCONT)  # a wakes up mid-step, sure it still owns them
        for i, j in enumerate(jobs):
            res = j.result(timeout=60)
            assert res.text == expected_for_prompt(f"held {i}", 120) and res.worker == "rescuer"
        time.sleep(1.0)  # give the resumed worker time to try (and fail) to write
        assert a.poll() is None, "the resumed worker died"
    finally:
        os.kill(a.pid, signal.SIGCONT)
        stop_proc(a, 20)
        if b is not None:
            stop_proc(b, 20)
    assert pool_problems(c, jobs) == {}
    # b resumed each job after the tokens a had published (pool_problems checks the counts)
    for j in jobs:
        types = [e.type for e in raw_events(c, j.id)]
        assert types.count("resume") == 1 and "restart" not in types, types
