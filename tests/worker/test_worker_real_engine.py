"""The worker over a real (tiny) engine and real Redis: what the fake engine cannot show, the
engine's own abort outputs and max_tokens cap (issue 28, items 4 and 7)."""
from __future__ import annotations

import time

import pytest

from genpool.engine import LLM
from genpool.schemas import parse_event
from tests.pool_helpers import client_env, wait_for, worker_thread


@pytest.fixture
def env(redis_url):
    with client_env(redis_url, "wre") as e:
        yield e


def slow_engine(path, step_s: float, **kw):
    """A tiny-model engine whose steps take at least step_s (jobs last long enough to act on)."""
    eng = LLM(str(path), num_threads=1, **kw).llm_engine
    step = eng.step

    def slow_step():
        time.sleep(step_s)
        return step()

    eng.step = slow_step
    return eng


def events(c, job_id: str) -> list:
    return [parse_event(f["event"]) for _, f in c.redis.xrange(c.keys.events(job_id))]


def test_a_rerun_on_the_same_worker_is_not_ended_by_its_first_attempts_abort(env, tiny_llama_path):
    """The job's lease is lost mid-run (here taken by hand; in the issue its hash expired, with a
    client job_ttl_s shorter than the job): the worker aborts it in its engine, which has that
    abort's output queued for its next step. The same worker then reclaims the entry and reruns
    the job; the queued abort must not end the rerun as an empty 'successful' result."""
    url, prefix, c = env
    eng = slow_engine(tiny_llama_path, 0.01, num_kv_blocks=256)
    with worker_thread(eng, url, prefix, claim_idle_ms=1000, heartbeat_s=0.2) as w:
        job = c.submit(prompt="tell me a story", max_tokens=300, ignore_eos=True)
        wait_for(lambda: any(e.type == "token" for e in events(c, job.id)), 30, what="a token")
        c.redis.hset(c.keys.job(job.id), mapping={"owner": "thief/0", "lease_until": 0})
        wait_for(lambda: w.counts["lost"], 10, what="the lease loss noticed")
        res = job.result(timeout=60)
        assert (res.finish_reason, res.usage.completion_tokens) == ("length", 300), res
        assert len(res.token_ids) == 300 and res.text
        # the reclaim resumed it after what the first attempt had published: no restart
        types = [e.type for e in events(c, job.id)]
        assert types.count("resume") == 1 and "restart" not in types, types
        assert c.job(job.id).info()["state"] == "done"
        # and no attempt is left running in the engine, orphaned
        wait_for(lambda: not eng.has_unfinished_requests() and not w.jobs.running, 10,
                 what=lambda: f"an idle engine ({eng.stats().num_requests} requests)")


def test_a_huge_max_tokens_does_not_hold_back_other_jobs(env, tiny_llama_path):
    """Admission sizes a job's KV worst case by prompt + max_tokens; the engine caps that to the
    model's length (2048 here), so max_tokens=10**6 must count as what it can really use, not
    62,500 blocks that leave no room for anyone (the cache has 1024)."""
    url, prefix, c = env
    eng = slow_engine(tiny_llama_path, 0.01, num_kv_blocks=1024)
    with worker_thread(eng, url, prefix) as w:
        big = c.submit(prompt="A", max_tokens=10**6, ignore_eos=True)
        wait_for(lambda: any(e.type == "token" for e in events(c, big.id)), 30, what="a token")
        small = [c.submit(prompt=f"B{i}", max_tokens=4, priority=p)  # normal and low lanes
                 for i, p in enumerate((0, 1, 0))]
        for job in small:  # big runs ~2000 steps of >= 10 ms: these must not wait for it
            assert job.result(timeout=10).finish_reason == "length"
        assert c.job(big.id).info()["state"] == "running"
        assert w.capacity() > 0
        big.cancel()


def test_a_job_whose_constraint_matches_nothing_fails_alone_and_the_worker_serves_on(
        env, tiny_llama_path):
    """n=2 and a regex that compiles but matches no string: the engine step raised (KeyError),
    and the worker stopped with the jobs beside it; a peer taking the job over went down too."""
    url, prefix, c = env
    eng = LLM(str(tiny_llama_path), num_threads=1, num_kv_blocks=256).llm_engine
    with worker_thread(eng, url, prefix) as w:
        beside = c.submit(prompt="A", max_tokens=30, ignore_eos=True)
        bad = c.submit(prompt="B", max_tokens=5, n=2, structured_outputs={"regex": "[^\\s\\S]"})
        res = bad.result(timeout=30, raise_on_error=False)
        assert res.error is not None and res.error.code == "invalid_request", res
        assert beside.result(timeout=30).finish_reason == "length"
        after = c.submit(prompt="C", max_tokens=3)
        assert after.result(timeout=30).finish_reason == "length"
        assert not w.stopping
