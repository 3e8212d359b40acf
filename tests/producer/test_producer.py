"""Producer clients against real Redis, with events written by hand (no worker)."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from genpool.producer import AsyncClient, Client
from genpool.producer.replay import Replay
from genpool.schemas import ErrorEvent, RestartEvent, ResultEvent, ResumeEvent, TokenEvent
from genpool.schemas.connection import connect
from tests.pool_helpers import drop_prefix, new_prefix


@pytest.fixture
def client(topology_url):
    """One server, then a 3-master Redis Cluster (tests/conftest.py)."""
    prefix = new_prefix("prod")
    c = Client(topology_url, prefix)
    yield c
    c.close()
    drop_prefix(topology_url, prefix)


def _write(c: Client, job_id: str, *events) -> None:
    for ev in events:
        c.redis.xadd(c.keys.events(job_id), {"event": ev.model_dump_json()})


def tok(text: str, *ids: int) -> TokenEvent:
    return TokenEvent(text=text, token_ids=list(ids))


def test_replay_swallows_identical_rerun():
    rp = Replay()
    seen = []
    for ev in [tok("Hel", 1), tok("lo", 2), RestartEvent(), tok("Hel", 1), tok("lo", 2),
               tok(" you", 3), ResultEvent(text="Hello you", token_ids=[1, 2, 3])]:
        seen += rp.feed(ev)
    assert "".join(e.text for e in seen if e.type == "token") == "Hello you"
    assert [e.type for e in seen] == ["token", "token", "token", "result"]
    assert seen[2].token_ids == [3]


def test_replay_reports_a_diverging_rerun():
    rp = Replay()
    seen = []
    for ev in [tok("ab", 1), RestartEvent(), tok("ax", 9), ResultEvent(text="ax")]:
        seen += rp.feed(ev)
    assert [e.type for e in seen] == ["token", "restart", "token", "result"]
    assert seen[2].text == "ax"


def test_replay_rerun_that_ends_short():
    seen = []
    rp = Replay()
    for ev in [tok("abc", 1, 2), RestartEvent(), tok("a", 1), ResultEvent(text="a")]:
        seen += rp.feed(ev)
    assert [e.type for e in seen] == ["token", "restart", "token", "result"]


def test_a_resume_after_exactly_what_the_reader_saw_is_invisible():
    rp, seen = Replay(), []
    for ev in [tok("Hel", 1), tok("lo", 2), ResumeEvent(attempt=2, tokens=[2]), tok(" you", 3),
               ResultEvent(text="Hello you", token_ids=[1, 2, 3])]:
        seen += rp.feed(ev)
    assert [e.type for e in seen] == ["token", "token", "token", "result"]
    assert "".join(e.text for e in seen[:-1]) == "Hello you"


def test_a_resume_from_fewer_tokens_than_shown_rewinds_by_token_index():
    """Redis lost the tail the reader had seen (AOF everysec, a failover): the taker resumes
    after the durable tokens, and the reader is told what to drop before the continuation."""
    rp, seen = Replay(), []
    for ev in [tok("Hel", 1), tok("lo", 2, 3), tok("!", 4), ResumeEvent(attempt=2, tokens=[1]),
               tok("p me", 5, 6), ResultEvent(text="Help me", token_ids=[1, 5, 6])]:
        seen += rp.feed(ev)
    assert [e.type for e in seen] == ["token", "token", "token", "rewind", "token", "result"]
    rw = seen[3]
    assert (rw.index, rw.token_index, rw.dropped, rw.dropped_text) == (0, 1, 3, "lo!")
    shown = ""
    for e in seen[:-1]:
        shown = shown[:len(shown) - len(e.dropped_text)] if e.type == "rewind" else shown + e.text
    assert shown == "Help me"  # what the reader ends with is the result's text


def test_a_rewind_names_each_completion_it_cuts():
    rp, seen = Replay(), []
    for ev in [TokenEvent(index=0, text="a", token_ids=[1]),
               TokenEvent(index=1, text="b", token_ids=[2]),
               TokenEvent(index=1, text="c", token_ids=[3]),
               ResumeEvent(attempt=2, tokens=[1, 1])]:
        seen += rp.feed(ev)
    (rw,) = [e for e in seen if e.type == "rewind"]
    assert (rw.index, rw.token_index, rw.dropped_text) == (1, 1, "c")


def test_submit_validates_locally(client):
    with pytest.raises(ValueError, match=r"max_tokens: Input should be greater than or equal"):
        client.submit("x", max_tokens=-1)
    with pytest.raises(ValueError, match="max_tokens 0 needs prompt_logprobs"):
        client.submit("x", max_tokens=0)
    with pytest.raises(ValueError, match="unknown field 'temprature'"):
        client.submit("x", temprature=0.5)
    with pytest.raises(ValueError, match="exactly one of 'prompt', 'messages' or 'prompt_token_ids'"):
        client.submit()


def test_submit_is_idempotent_per_id(client):
    a = client.submit("x", job_id="same", priority=-1)
    b = client.submit("y", job_id="same")
    many = client.submit_many([{"prompt": "z", "job_id": "same"}, {"prompt": "w"}])
    assert not a.duplicate and b.duplicate and many[0].duplicate and not many[1].duplicate
    assert client.redis.xlen(client.keys.jobs("high")) == 1
    assert client.redis.xlen(client.keys.jobs("normal")) == 1
    info = client.job("same").info()
    assert info["state"] == "queued" and info["lane"] == "high" and info["entry"]


def test_stream_and_result(client):
    job = client.submit("x")

    def worker():
        time.sleep(0.2)
        _write(client, job.id, tok("a", 1), tok("b", 2))
        time.sleep(0.2)
        res = ResultEvent(text="ab", token_ids=[1, 2], finish_reason="length")
        client.redis.hset(client.keys.job(job.id), "result", res.model_dump_json())
        _write(client, job.id, res)

    threading.Thread(target=worker).start()
    assert "".join(e.text for e in job.stream(timeout=5)) == "ab"
    assert job.result().text == "ab"
    late = client.job(job.id)  # a reader that connects late replays the stream / reads the hash
    assert [e.text for e in late.stream(timeout=5)] == ["a", "b"]
    assert client.job(job.id).result(timeout=1).finish_reason == "length"


def test_result_waits_and_times_out(client):
    job = client.submit("x")
    with pytest.raises(TimeoutError):
        job.result(timeout=0.3)
    _write(client, job.id, ErrorEvent(code="expired", message="too late"))
    res = client.job(job.id).result(timeout=2, raise_on_error=False)
    assert res.error.code == "expired" and not res.ok


def test_a_resume_with_a_negative_count_is_skipped_not_raised(client):
    """`tokens: [-1]` (someone else's write) raised ValueError out of the reader's replay."""
    job = client.submit("x")
    bad = ResumeEvent(attempt=2, tokens=[1]).model_dump_json().replace("[1]", "[-1]")
    _write(client, job.id, tok("a", 1))
    client.redis.xadd(client.keys.events(job.id), {"event": bad})
    _write(client, job.id, tok("b", 2), ResultEvent(text="ab", token_ids=[1, 2]))
    assert "".join(e.text for e in client.job(job.id).stream(timeout=5)) == "ab"
    assert client.job(job.id).result(timeout=2).text == "ab"


def test_cancel_sets_flag_and_broadcasts(client):
    job = client.submit("x")
    job.cancel()
    assert client.redis.hget(client.keys.job(job.id), "cancel") == "1"
    (_, fields), = client.redis.xrange(client.keys.control)
    assert fields == {"op": "cancel", "id": job.id}
    assert client.redis.ttl(client.keys.job(job.id)) > 0


def test_status(client):
    client.submit_many([{"prompt": "a", "priority": p} for p in (-1, 0, 0, 5)])
    st = client.status()
    assert {k: v["queued"] for k, v in st["lanes"].items()} == {"high": 1, "normal": 2, "low": 1}
    assert st["dead"]["count"] == 0 and st["workers"] == []


def test_async_client(topology_url):
    redis_url, prefix = topology_url, new_prefix("aio")

    async def main():
        async with AsyncClient(redis_url, prefix) as ac:
            jobs = await ac.submit_many([{"prompt": f"p{i}", "job_id": f"j{i}"}
                                         for i in range(250)])
            dup = await ac.submit("again", job_id="j3")
            assert dup.duplicate and not any(j.duplicate for j in jobs)
            r = connect(redis_url)
            for ev in (tok("x", 1), tok("y", 2), ResultEvent(text="xy")):
                r.xadd(ac.keys.events("j7"), {"event": ev.model_dump_json()})
            texts = [e.text async for e in jobs[7].stream(timeout=5)]
            assert texts == ["x", "y"] and (await jobs[7].result()).text == "xy"
            await jobs[8].cancel()
            assert r.hget(ac.keys.job("j8"), "cancel") == b"1"
            with pytest.raises(TimeoutError):
                await jobs[9].result(timeout=0.2)

    try:
        asyncio.run(main())
    finally:
        drop_prefix(redis_url, prefix)


@pytest.mark.skipif(not hasattr(asyncio.Task, "cancelling"), reason="Task.cancelling() is Python 3.11+")
def test_waiting_for_events_stops_on_one_cancel(redis_url, monkeypatch):
    """redis-py's asyncio client swallowed about 1 in 8 cancels that landed 0.5-1.5 ms into an XREAD
    BLOCK; a job's event reader must still stop on the first cancel, wherever it lands: at its next
    read at the latest (reads block 200 ms here instead of 5 s)."""
    from genpool.producer import protocol

    monkeypatch.setattr(protocol, "READ_BLOCK_MS", 200)
    prefix = new_prefix("aiocancel")

    async def main():
        stuck = []
        async with AsyncClient(redis_url, prefix) as ac:
            job = ac.job("nothing-yet")  # no events will come: the reader blocks on XREAD
            for i in range(40):
                task = asyncio.ensure_future(job.result())
                await asyncio.sleep((i % 20) * 0.0005)
                task.cancel()
                done, _ = await asyncio.wait({task}, timeout=1.0)
                if not done:
                    stuck.append((i % 20) * 0.5)
                    while not task.done():  # clean up before the loop closes
                        task.cancel()
                        await asyncio.wait({task}, timeout=0.2)
        return stuck

    try:
        assert asyncio.run(main()) == []  # delays (ms) at which one cancel did not stop it
    finally:
        drop_prefix(redis_url, prefix)


def test_a_quiet_wait_is_no_lost_connection(redis_url, caplog):
    """A reader with no timeout on a job that stays quiet (queued behind busy workers) for
    longer than one XREAD BLOCK: a healthy Redis must not look lost. redis-py 8 defaults to a
    5 s socket timeout, which equals the 5 s block, so every quiet read timed out, and 30 s
    later the gateway answered 503 queue_unavailable (found by a hostile run)."""
    prefix = new_prefix("quiet")
    c, got = Client(redis_url, prefix), {}

    def sync_reader():
        got["sync"] = c.job("q1").result()

    def async_reader():
        async def main():
            ac = AsyncClient(redis_url, prefix)
            try:
                got["async"] = await ac.job("q1").result()
            finally:
                await ac.close()
        asyncio.run(main())

    readers = [threading.Thread(target=sync_reader), threading.Thread(target=async_reader)]
    try:
        for t in readers:
            t.start()
        time.sleep(11)  # two quiet 5 s blocks: the second failed read is where it was reported
        _write(c, "q1", tok("hi", 5), ResultEvent(text="hi", token_ids=[5]))
        for t in readers:
            t.join(15)
        assert got["sync"].text == got["async"].text == "hi"
        assert not [r for r in caplog.records if "lost the connection" in r.getMessage()]
    finally:
        c.close()
        drop_prefix(redis_url, prefix)
