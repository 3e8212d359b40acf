"""Data someone else wrote into the deployment's Redis keys (a buggy or hostile producer, peer or
operator) fails the job it belongs to at most, never the worker: each case below stopped the
worker thread (UnicodeDecodeError, a claim reply cut short by a nil, a strict model's
ValidationError, a shard count past the bound) or its reconnect. Real Redis, the fake engine."""
from __future__ import annotations

import json
import threading
import time

import pytest
import redis

from genpool.schemas.connection import connect, stored_shards
from genpool.schemas.tenants import TenantKeys
from genpool.workers.recovery import Recovery
from tests.fake_engine import FakeEngine, expected_for_prompt
from tests.pool_helpers import client_env, wait_for, worker_thread


@pytest.fixture
def env(redis_url):
    with client_env(redis_url, "hostile") as e:
        yield e


def runs(c, prompt: str = "after", timeout: float = 20) -> None:
    """A plain job is still served: the worker is alive."""
    assert c.submit(prompt=prompt, max_tokens=3).result(timeout=timeout).text == \
        expected_for_prompt(prompt, 3)


def test_garbage_in_job_hashes_fails_no_worker(env):
    url, prefix, c = env
    bad_state, bad_attempts, bad_suspect, plain = c.submit_many(
        [dict(prompt=f"p{i}", max_tokens=3) for i in range(4)])
    c.redis.hset(c.keys.job(bad_state.id), "state", b"\xff")
    c.redis.hset(c.keys.job(bad_attempts.id), mapping={"attempts": "x", "cancel": "1"})
    c.redis.hset(c.keys.job(bad_suspect.id), "suspect", "x")
    with worker_thread(FakeEngine(max_num_seqs=8), url, prefix, claim_idle_ms=300,
                       heartbeat_s=0.1):
        assert plain.result(timeout=20).text == expected_for_prompt("p3", 3)
        assert bad_suspect.result(timeout=20).text == expected_for_prompt("p2", 3)
        assert bad_attempts.result(timeout=20, raise_on_error=False).finish_reason == "cancelled"
        runs(c)


def test_a_tenant_name_of_bad_bytes_in_the_weights_stops_no_worker(env):
    url, prefix, c = env
    weights = TenantKeys(c.keys).weights
    c.redis.hset(weights, mapping={b"\xff": 1, "acme": "\xc2\xb2"})
    c.redis.expire(weights, 600)
    with worker_thread(FakeEngine(max_num_seqs=4), url, prefix, heartbeat_s=0.1):
        runs(c)


def test_an_event_log_entry_with_a_bad_field_name_reruns_its_job(env):
    """A worker that takes the job over reads the log: a field name that is no UTF-8 stopped it
    in plan(), then every worker that claimed the job in turn."""
    url, prefix, c = env
    job = c.submit(prompt="taken", max_tokens=3)
    c.redis.hset(c.keys.job(job.id), "attempts", 1)  # as if an earlier attempt ran
    c.redis.xadd(c.keys.events(job.id), {b"\xff": b"1"})
    with worker_thread(FakeEngine(max_num_seqs=4), url, prefix, heartbeat_s=0.1):
        # (judged by the job hash: a reader of this job's stream, which decodes its replies,
        # cannot read that entry; docs/protocol.md says so)
        wait_for(lambda: c.redis.hget(c.keys.job(job.id), "state") == "done", 20,
                 what="the job rerun and done")
        assert json.loads(c.redis.hget(c.keys.job(job.id), "result"))["text"] == \
            expected_for_prompt("taken", 3)
        runs(c)


def test_unreadable_tenant_limits_leave_the_job_uncapped(env):
    """A limits record with a field this version does not know (a newer tool's, or anyone's
    write) failed the strict model in the claim path."""
    url, prefix, c = env
    key = TenantKeys(c.keys).limits("acme")
    c.redis.set(key, '{"max_concurrent": 5, "newer_field": 1}', ex=600)
    with worker_thread(FakeEngine(max_num_seqs=4), url, prefix, heartbeat_s=0.1):
        assert c.submit(prompt="capped", max_tokens=3, tenant="acme").result(timeout=20).text \
            == expected_for_prompt("capped", 3)


@pytest.mark.parametrize("value", ["100", "abc", "0", "²"])
def test_a_lane_shard_count_out_of_range_stops_no_worker_and_no_producer(env, value):
    url, prefix, c = env
    c.redis.hset(c.keys.meta, "lane_shards", value)
    c.redis.expire(c.keys.meta, 600)
    assert stored_shards(value) == 1
    with worker_thread(FakeEngine(max_num_seqs=4), url, prefix, heartbeat_s=0.1):
        runs(c)
    assert c.redis.hget(c.keys.meta, "lane_shards") == "1"  # the worker's own count replaced it


def test_a_refusal_while_reconnecting_is_waited_out(redis_url):
    """After a lost connection, the lanes' refresh met an OOM refusal (Redis at maxmemory under
    noeviction): the error escaped _reconnect and stopped the worker."""
    calls = []

    def refresh() -> None:
        calls.append(1)
        if len(calls) < 3:
            raise redis.ResponseError("OOM command not allowed when used memory > 'maxmemory'.")
    r = connect(redis_url)
    counts = {"reconnects": 0}
    try:
        rec = Recovery(r, None, None, None, counts, threading.Event(), refresh,
                       give_up=lambda: False, stopping=lambda: False)
        rec._reconnect(attempts=10)
    finally:
        r.close()
    assert len(calls) == 3 and counts["reconnects"] == 1 and counts["refused"] == 2


def test_a_job_whose_events_key_was_clobbered_is_dead_lettered_once(env):
    """Its events stream made a string: every write of the job failed WRONGTYPE and was only
    logged, so its entry stayed pending and the job reran after every lease expiry, unanswered,
    for ever. Its entry is dead-lettered now, once, and the job is not run again."""
    url, prefix, c = env
    job = c.submit(prompt="clobbered", max_tokens=3)
    c.redis.set(c.keys.events(job.id), "not a stream", ex=600)
    with worker_thread(FakeEngine(max_num_seqs=4), url, prefix, claim_idle_ms=300,
                       heartbeat_s=0.1):
        wait_for(lambda: c.redis.xlen(c.keys.dead) == 1, what="one dead letter")
        runs(c)  # > 3 claim windows on: no rerun, no second letter
        time.sleep(1.2)
        assert c.redis.xlen(c.keys.dead) == 1
        assert c.redis.hget(c.keys.job(job.id), "attempts") == "1"
    (_, dead), = c.redis.xrange(c.keys.dead)
    assert "cannot be written" in dead["reason"] and dead["job_id"] == job.id


def test_a_clobbered_usage_bucket_dead_letters_no_job(env):
    """The hour's usage bucket (one key shared by every job) made a string: the result script
    fails WRONGTYPE after it stored the result, so the job is done and only acknowledged, not
    dead-lettered (as a job whose own keys are clobbered is)."""
    url, prefix, c = env
    from genpool.schemas.tenants import USAGE_BUCKET_S

    c.redis.set(TenantKeys(c.keys).usage(int(time.time()) // USAGE_BUCKET_S), "x", ex=600)
    with worker_thread(FakeEngine(max_num_seqs=4), url, prefix, claim_idle_ms=300,
                       heartbeat_s=0.1):
        runs(c, "billed")
        runs(c, "billed again")
        time.sleep(1.0)  # > 3 claim windows: a pending entry would have been reclaimed
    assert c.redis.xlen(c.keys.dead) == 0
    assert c.status()["lanes"]["normal"] == {"queued": 0, "pending": 0}


def test_a_limits_record_keeps_its_readable_fields():
    """One invalid value lifted every limit of the tenant (the strict model refused the record)."""
    from genpool.schemas.tenant_records import TenantLimits, read_limits

    assert read_limits('{"rpm": 10.0, "tpm": 5000, "newer_field": 1}') == TenantLimits(tpm=5000)
    assert read_limits('{"weight": 1001, "max_concurrent": 2}') == TenantLimits(max_concurrent=2)
    assert read_limits("[1]") == read_limits(b"\xff") == read_limits(None) == TenantLimits()
