"""A reader that falls behind a job's capped event stream (MAXLEN ~16,384) by more than the cap
is told how many events it lost, and still gets the whole result (issue 28, item 12)."""
from __future__ import annotations

import asyncio
import string

import pytest

from genpool.producer import AsyncClient, Client
from genpool.schemas import ResultEvent, TokenEvent, TrimmedEvent
from tests.fake_engine import FakeEngine, expected_for_prompt
from tests.pool_helpers import client_env, wait_for, worker_thread

CAP, N = 16384, 20000
TEXT = "".join(string.ascii_letters[i % 52] for i in range(N))


@pytest.fixture
def client(topology_url):
    """One server, then a 3-master Redis Cluster (tests/conftest.py)."""
    with client_env(topology_url, "trim") as (_, _, c):
        yield c


def write_job(c: Client, job_id: str, upto: int = N, start: int = 0, final: bool = True) -> None:
    """What a worker writes (FENCE_LUA): one token event per character, each entry numbered
    (`seq`), the stream capped at ~CAP entries."""
    pipe = c.redis.pipeline(transaction=False)
    evs = [TokenEvent(attempt=1, text=TEXT[i], token_ids=[i]) for i in range(start, upto)]
    if final:
        evs.append(ResultEvent(attempt=1, text=TEXT, token_ids=list(range(N)),
                               finish_reason="length"))
    for seq, ev in enumerate(evs, start + 1):
        pipe.xadd(c.keys.events(job_id), {"event": ev.model_dump_json(), "seq": seq},
                  maxlen=CAP, approximate=True)
    pipe.expire(c.keys.events(job_id), 600)
    pipe.execute()


def lost_so_far(c: Client, job_id: str, written: int = N + 1) -> int:
    return written - c.redis.xlen(c.keys.events(job_id))  # (nothing but the cap deletes)


def read(events) -> tuple[str, list[TrimmedEvent]]:
    text, gaps = "", []
    for ev in events:
        if isinstance(ev, TrimmedEvent):
            assert text == "" or gaps == [], "one gap here, told once, before what follows it"
            gaps.append(ev)
        else:
            text += ev.text
    return text, gaps


def test_a_reader_that_starts_late_is_told_what_was_trimmed(client):
    c = client
    write_job(c, "late")
    lost = lost_so_far(c, "late")
    assert lost > 0  # the cap dropped the oldest events
    job = c.job("late")
    text, gaps = read(job.stream(timeout=10))
    assert [g.events for g in gaps] == [lost] and len(text) == N - lost
    assert text == TEXT[lost:]  # what follows the gap is exactly what is left
    assert job.result(timeout=1).text == TEXT  # the result still carries the whole text
    assert c.job("late").result(timeout=1).text == TEXT  # (and so does a fresh handle's)


def test_a_reader_stalled_mid_stream_is_told_at_the_gap(client):
    c = client
    write_job(c, "stall", upto=100, final=False)
    job = c.job("stall")
    events = job.stream(timeout=10)
    head = "".join(next(events).text for _ in range(100))
    assert head == TEXT[:100]
    write_job(c, "stall", start=100)  # the reader sleeps while all of the rest is written
    lost = lost_so_far(c, "stall")
    assert lost > 100  # past where it stopped reading
    text, gaps = read(events)
    assert [g.events for g in gaps] == [lost - 100]
    assert head + text == TEXT[:100] + TEXT[lost:]
    assert job.result(timeout=1).text == TEXT


def test_a_reader_that_keeps_up_is_told_nothing(client):
    c = client
    write_job(c, "short", upto=3000)  # below the cap: nothing trimmed
    text, gaps = read(c.job("short").stream(timeout=10))
    assert gaps == [] and text == TEXT[:3000]


def test_async_reader_is_told_too(client):
    c = client
    write_job(c, "late-a")
    lost = lost_so_far(c, "late-a")

    async def go():
        async with AsyncClient(c.url, c.keys.prefix) as ac:
            job = ac.job("late-a")
            seen = [ev async for ev in job.stream(timeout=10)]
            return seen, await job.result(timeout=1)
    seen, res = asyncio.run(go())
    assert [e.events for e in seen if isinstance(e, TrimmedEvent)] == [lost]
    assert "".join(e.text for e in seen) == TEXT[lost:] and res.text == TEXT


def test_with_a_worker_and_a_small_cap(redis_url):
    """The same through a real worker loop with `--events-maxlen 1000`."""
    with client_env(redis_url, "trim") as (url, prefix, c):
        with worker_thread(FakeEngine(max_model_len=8192), url, prefix, events_maxlen=1000):
            job = c.submit("p long", max_tokens=3000)
            wait_for(lambda: c.job(job.id).info().get("state") == "done", timeout=60,
                     what="the job done before anyone read it")
        want = expected_for_prompt("p long", 3000)
        text, gaps = read(job.stream(timeout=10))
        assert len(gaps) == 1 and gaps[0].events == 3000 - len(text) > 0
        assert text == want[-len(text):] and job.result(timeout=1).text == want


def test_cli_says_so_and_job_result_prints_it_all(redis_url):
    from tests.producer.test_ux import genpool

    with client_env(redis_url, "trim") as (url, prefix, c):
        c.redis.hset(c.keys.job("late"), mapping={"state": "done", "result": ResultEvent(
            attempt=1, text=TEXT, finish_reason="length").model_dump_json()})
        c.redis.expire(c.keys.job("late"), 600)
        write_job(c, "late")
        lost = lost_so_far(c, "late")
        conn = ["--redis", url, "--prefix", prefix]
        out = genpool("job", "stream", "late", *conn)
        assert out.returncode == 0 and out.stdout.strip() == TEXT[lost:]
        assert f"{lost} events were trimmed" in out.stderr
        assert "`genpool job result late` prints all of it" in out.stderr
        assert genpool("job", "result", "late", *conn).stdout.strip() == TEXT
