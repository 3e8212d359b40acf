"""`genpool dead retry` never replaces a job that is not dead (issue 28, item 13): a dead letter
is input anyone can XADD, so one naming a finished (or queued, or running) job's id must be
refused, and the job's result, state and entry left as they were."""
from __future__ import annotations

import json

import pytest

from genpool.producer import Client
from genpool.producer.dead import retry_dead
from tests.fake_engine import FakeEngine, expected_for_prompt
from tests.pool_helpers import drop_prefix, new_prefix, wait_for, worker_thread
from tests.producer.test_lanes import poison
from tests.producer.test_ux import genpool


@pytest.fixture
def client(topology_url):
    """One server, then a 3-master Redis Cluster (tests/conftest.py)."""
    prefix = new_prefix("dead")
    c = Client(topology_url, prefix)
    yield c
    c.close()
    drop_prefix(topology_url, prefix)


def forge(c: Client, job_id: str, prompt: str = "p forged") -> str:
    return c.redis.xadd(c.keys.dead, {
        "reason": "forged", "stream": c.keys.jobs("normal"), "source_entry": "1-1",
        "deliveries": "9", "worker": "nobody", "at": "0", "job_id": job_id,
        "payload": json.dumps({"id": job_id, "prompt": prompt, "max_tokens": 3})})


def test_a_forged_dead_letter_never_replaces_a_finished_job(client):
    c = client
    with worker_thread(FakeEngine(), c.url, c.keys.prefix):
        done = c.submit("p real", max_tokens=3)
        real = done.result(timeout=10)
    queued = c.submit("p queued", max_tokens=3)  # no worker now: it stays queued
    before = {j: c.redis.hgetall(c.keys.job(j)) for j in (done.id, queued.id)}
    events = c.redis.xlen(c.keys.events(done.id))
    letters = [forge(c, done.id), forge(c, queued.id)]
    ok, refused = retry_dead(c, None)
    assert ok == [] and sorted(e for e, _ in refused) == sorted(letters)
    why = dict(refused)
    assert "done" in why[letters[0]] and "queued" in why[letters[1]]
    for j in (done.id, queued.id):  # nothing of either job was touched
        assert c.redis.hgetall(c.keys.job(j)) == before[j]
    assert c.redis.xlen(c.keys.events(done.id)) == events
    assert c.job(done.id).result(timeout=1).text == real.text
    assert c.redis.xlen(c.keys.dead) == 2  # refused letters are kept (purge them)
    assert c.redis.xlen(c.keys.jobs("normal")) == 1  # only the queued job's own entry


def test_a_dead_job_is_still_retried(client):
    c = client
    job = c.submit("retry me", max_tokens=3)
    with worker_thread(FakeEngine(), c.url, c.keys.prefix, max_deliveries=0):
        wait_for(lambda: c.redis.xlen(c.keys.dead) == 1, what="a dead letter")
    assert c.job(job.id).info()["state"] == "dead"
    forge(c, "never-existed", "p new")  # a letter for an id with no job: queued as a new one
    ok, refused = retry_dead(c, None)
    assert sorted(j for _, j in ok) == sorted([job.id, "never-existed"]) and refused == []
    with worker_thread(FakeEngine(), c.url, c.keys.prefix):
        assert c.job(job.id).result(timeout=10).text == expected_for_prompt("retry me", 3)
        assert c.job("never-existed").result(timeout=10).text == expected_for_prompt("p new", 3)


def test_a_retry_into_a_refusing_lane_keeps_its_dead_letter(client):
    """Its lane refuses the XADD: the dead letter stays, nothing is left without a TTL, and the
    same retry goes through once the lane is repaired."""
    c = client
    letter = forge(c, "late", "p late")
    poison(c, "junk")
    ok, refused = retry_dead(c, None)
    assert ok == [] and refused[0][0] == letter and "genpool lanes repair" in refused[0][1]
    assert c.redis.xlen(c.keys.dead) == 1
    assert c.redis.ttl(c.keys.job("late")) in (-2, *range(1, 7 * 86400 + 1))
    assert genpool("lanes", "repair", "--redis", c.url, "--prefix", c.keys.prefix).returncode == 0
    ok, refused = retry_dead(c, None)
    assert ok == [(letter, "late")] and refused == []


def test_cli_retry_all_says_why_a_finished_job_is_refused(redis_url):
    prefix = new_prefix("dead")
    c = Client(redis_url, prefix)
    try:
        with worker_thread(FakeEngine(), redis_url, prefix):
            job = c.submit("p real", max_tokens=3)
            text = job.result(timeout=10).text
        forge(c, job.id)
        out = genpool("dead", "retry", "--all", "--redis", redis_url, "--prefix", prefix)
        assert out.returncode == 1 and f"job {job.id} is done" in out.stderr, out.stderr
        assert c.job(job.id).info()["state"] == "done"
        assert c.job(job.id).result(timeout=1).text == text
    finally:
        c.close()
        drop_prefix(redis_url, prefix)


def test_dead_letters_of_any_bytes_are_listed_and_refused_not_fatal(client):
    """A dead letter anyone XADDed in bytes that are no UTF-8 stopped `dead list` and
    `dead retry --all` for every entry; an id of milliseconds alone named every entry of that
    millisecond; --all read the whole stream in one reply (it reads pages now)."""
    c = client
    junk = c.redis.xadd(c.keys.dead, {b"reason": b"\xff\xfe", b"payload": b"\xff"})
    letters = [forge(c, f"gone-{i}") for i in range(4)]
    listed = genpool("dead", "list", "--json", "--redis", c.url, "--prefix", c.keys.prefix)
    assert listed.returncode == 0, listed.stderr
    assert len(listed.stdout.splitlines()) == 5 and "\ufffd" in listed.stdout
    ms = letters[0].split("-")[0]
    ok, refused = retry_dead(c, [ms])
    assert ok == [] and refused == [(ms, "no such dead-letter entry")]
    from genpool.producer.dead import _every_dead
    calls = []
    real = c.raw.xrange
    c.raw.xrange = lambda *a, **kw: calls.append(kw.get("count")) or real(*a, **kw)
    try:
        seen = [d["entry"] for d in _every_dead(c, page=2)]
    finally:
        del c.raw.xrange
    assert seen == [junk, *letters] and calls == [2, 2, 2, 2]
    pages = _every_dead(c, page=2)
    first = next(pages)
    late = forge(c, "gone-late")  # dead-lettered while the pass runs: not in it
    assert [first["entry"], *(d["entry"] for d in pages)] == [junk, *letters]
    c.redis.xdel(c.keys.dead, late)
    ok, refused = retry_dead(c, None)
    assert sorted(e for e, _ in ok) == sorted(letters) and [e for e, _ in refused] == [junk]
    with worker_thread(FakeEngine(), c.url, c.keys.prefix):
        assert c.job("gone-0").result(timeout=10).text == expected_for_prompt("p forged", 3)
