"""A lane stream whose last id was pushed to the end of the id space (issue 28, item 9): submits
fail cleanly and store nothing, and `genpool lanes repair` makes the lane take entries again
without losing a queued or running job."""
from __future__ import annotations

import asyncio
import json

import pytest
import redis

from genpool.producer import AsyncClient, Client
from genpool.schemas import Keys
from tests.fake_engine import FakeEngine, expected_for_prompt
from tests.pool_helpers import drop_prefix, new_prefix, wait_for, worker_thread
from tests.producer.test_ux import genpool

MAX_ID = "18446744073709551615-18446744073709551615"


@pytest.fixture
def client(topology_url):
    """One server, then a 3-master Redis Cluster (tests/conftest.py)."""
    prefix = new_prefix("lane")
    c = Client(topology_url, prefix)
    yield c
    c.close()
    drop_prefix(topology_url, prefix)


def poison(c: Client, job_id: str = "forged", lane: str = "normal") -> None:
    c.redis.xadd(c.keys.jobs(lane), {"job": json.dumps({"id": job_id, "prompt": "p forged",
                                                        "max_tokens": 2})}, id=MAX_ID)


def cli(c: Client, *args: str):
    return genpool("lanes", *args, "--redis", c.url, "--prefix", c.keys.prefix)


def test_a_refused_submit_stores_nothing(client):
    c = client
    c.redis.xgroup_create(c.keys.jobs("normal"), "workers", id="0", mkstream=True)
    poison(c)
    for attempt in range(2):  # a resubmit is refused the same way, never "a duplicate"
        with pytest.raises(redis.ResponseError, match="genpool lanes repair"):
            c.submit("p x", job_id="victim", max_tokens=2)
        assert not c.redis.exists(c.keys.job("victim")), c.redis.hgetall(c.keys.job("victim"))
    with pytest.raises(redis.ResponseError, match="genpool lanes repair"):
        c.submit_many([dict(prompt="p y", job_id="y"), dict(prompt="p z", job_id="z")])
    assert not c.redis.exists(c.keys.job("y")) and not c.redis.exists(c.keys.job("z"))

    async def go():
        async with AsyncClient(c.url, c.keys.prefix) as ac:
            with pytest.raises(redis.ResponseError, match="genpool lanes repair"):
                await ac.submit("p x", job_id="victim", max_tokens=2)
            with pytest.raises(redis.ResponseError, match="genpool lanes repair"):
                await ac.submit_many([dict(prompt="p y", job_id="y")])
    asyncio.run(go())
    assert not c.redis.exists(c.keys.job("victim")) and not c.redis.exists(c.keys.job("y"))
    # the other lanes are not affected
    assert not c.submit("p ok", job_id="high-one", priority=-1).duplicate


def test_repair_keeps_every_queued_job(client):
    """No worker was running: two jobs queued before the poison entry, which is a job too."""
    c = client
    before = c.submit_many([dict(prompt=f"p {i}", max_tokens=2) for i in range(2)])
    poison(c)
    with pytest.raises(redis.ResponseError):
        c.submit("p late", max_tokens=2)
    check = cli(c, "check")
    assert check.returncode == 1 and "normal" in check.stdout and "poisoned" in check.stdout
    fixed = cli(c, "repair")
    assert fixed.returncode == 0, fixed.stderr
    assert "forged" in fixed.stdout  # the poison entry's job is queued again, under a fresh id
    assert cli(c, "check").returncode == 0
    late = c.submit("p late", max_tokens=2)
    assert not late.duplicate
    with worker_thread(FakeEngine(), c.url, c.keys.prefix):
        for job, prompt in [*zip(before, ["p 0", "p 1"]), (late, "p late"),
                            (c.job("forged"), "p forged")]:
            assert job.result(timeout=15).text == expected_for_prompt(prompt, 2)
        wait_for(lambda: c.redis.xlen(c.keys.jobs("normal")) == 0, what="every entry acked")


@pytest.mark.parametrize("job", [b"\xff", b"[" * 100_000])
def test_repair_mends_a_lane_poisoned_by_an_entry_that_is_no_job(client, job):
    """The poison entry's job field is no UTF-8 (or JSON nested past any parser's depth): the
    repair script returned it raw, and decoding its reply stopped both commands."""
    c = client
    c.redis.xadd(c.keys.jobs("normal"), {"job": job}, id=MAX_ID)
    check = cli(c, "check")
    assert check.returncode == 1 and "poisoned" in check.stdout, check.stderr
    fixed = cli(c, "repair")
    assert fixed.returncode == 0, fixed.stderr
    assert cli(c, "check").returncode == 0
    assert not c.submit("p after", max_tokens=2).duplicate


def test_repair_after_a_worker_ran_the_poison_entry(redis_url):
    """A worker read the poison entry (the group's last-delivered id is the maximum too) and is
    still running another job of that lane: repair must not hand that one out again."""
    prefix = new_prefix("lane")
    c = Client(redis_url, prefix)
    try:
        lane = c.keys.jobs("normal")
        with worker_thread(FakeEngine(step_delay=0.02), redis_url, prefix) as w:
            long = c.submit("p long", max_tokens=2000)  # runs all through the test (cancelled)
            wait_for(lambda: long.id in w.jobs.running, what="the long job running")
            poison(c)
            assert c.job("forged").result(timeout=15).ok
            wait_for(lambda: c.redis.xpending(lane, "workers")["pending"] == 1,
                     what="the forged entry acked (its ack follows its result)")
            assert c.redis.xinfo_groups(lane)[0]["last-delivered-id"] == MAX_ID
            assert long.id in w.jobs.running
            fixed = cli(c, "repair")
            assert fixed.returncode == 0, fixed.stderr
            group = c.redis.xinfo_groups(lane)[0]
            # back to the newest entry it delivered: the long job's, which is not read again
            assert group["last-delivered-id"] == c.job(long.id).info()["entry"]
            assert group["pending"] == 1
            after = c.submit("p after", max_tokens=2)
            assert after.result(timeout=15).text == expected_for_prompt("p after", 2)
            wait_for(lambda: c.redis.xpending(lane, "workers")["pending"] == 1,
                     what="the short job acked (its ack follows its result)")
            held = c.redis.xpending_range(lane, "workers", "-", "+", 10)
            assert [h["times_delivered"] for h in held] == [1]  # not delivered again
            assert long.id in w.jobs.running
            long.cancel()
            res = long.result(timeout=30)
            assert res.finish_reason == "cancelled"
            assert expected_for_prompt("p long", 2000).startswith(res.text)
            assert int(c.job(long.id).info()["attempts"]) == 1  # never handed out twice
    finally:
        c.close()
        drop_prefix(redis_url, prefix)


def test_repair_of_a_healthy_pool_changes_nothing(client):
    c = client
    job = c.submit("p 1", max_tokens=2)
    lane = c.keys.jobs("normal")
    before = c.redis.xrange(lane)
    out = cli(c, "repair")
    assert out.returncode == 0 and "nothing to repair" in out.stdout
    assert c.redis.xrange(lane) == before and c.redis.exists(c.keys.job(job.id))
    assert Keys(c.keys.prefix).jobs("normal") == lane


def test_repair_frees_the_job_of_a_claimed_poison_entry(client):
    """The poison entry itself was read and claimed by a worker that is still on it: its copy
    must be able to take the job over (not be acked as a duplicate of the old entry id)."""
    c = client
    lane = c.keys.jobs("normal")
    c.redis.xgroup_create(lane, "workers", id="0", mkstream=True)
    first = c.submit("p first", max_tokens=2)
    poison(c)
    got = c.redis.xreadgroup("workers", "w1", {lane: ">"})  # w1 holds both entries
    held = [eid for eid, _ in got[0][1]]
    assert held[-1] == MAX_ID
    c.redis.hset(c.keys.job("forged"), mapping={"entry": MAX_ID, "state": "running"})
    c.redis.expire(c.keys.job("forged"), 600)
    fixed = cli(c, "repair")
    assert fixed.returncode == 0, fixed.stderr
    assert "entry" not in c.redis.hgetall(c.keys.job("forged"))  # the copy may claim it
    assert [p["message_id"] for p in c.redis.xpending_range(lane, "workers", "-", "+", 10)] \
        == held[:1]  # w1 still holds the first job; the poison entry's record is gone
    fresh = c.redis.xreadgroup("workers", "w2", {lane: ">"})[0][1]
    assert [json.loads(f["job"])["id"] for _, f in fresh] == ["forged"]  # only the copy
    assert c.job(first.id).info()["state"] == "queued"
