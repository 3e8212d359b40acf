"""Resume after Redis lost the tail of a job's stream (AOF everysec, a Sentinel failover that
promoted a replica behind the master): the taker continues from what is durable, and a reader
that had already seen the lost tail gets a `rewind` naming the token index, never different text.

The loss is simulated on a real Redis as Redis would leave it after such a restart: the stream's
last entries and the hash's `seq` counter go back together (both are in the same AOF)."""
from __future__ import annotations

import threading

import pytest

from genpool.schemas import RewindEvent
from tests.chaos_helpers import raw_events, stream_problems
from tests.fake_engine import FakeEngine, expected_for_prompt
from tests.pool_helpers import client_env, wait_for, worker_thread


@pytest.fixture
def env(redis_url):
    with client_env(redis_url, "tail") as e:
        yield e


def test_a_reader_that_saw_a_lost_tail_is_rewound_to_the_durable_token(env):
    url, prefix, c = env
    job = c.submit("lost tail", max_tokens=120)
    seen: list = []
    reader = threading.Thread(target=lambda: seen.extend(job.stream(timeout=60)), daemon=True)
    reader.start()
    with worker_thread(FakeEngine(step_delay=0.02), url, prefix, drain_timeout_s=0.2):
        wait_for(lambda: len(seen) >= 40, timeout=30, what="40 tokens read")
    # Redis "restarts" having kept only the first 20 entries (one token each here)
    key = c.keys.events(job.id)
    entries = c.redis.xrange(key)
    assert len(entries) > 20 + 5 and all('"type":"token"' in f["event"]
                                          for _, f in entries)
    c.redis.xdel(key, *[i for i, _ in entries[20:]])
    c.redis.hset(c.keys.job(job.id), "seq", 20)
    shown_before = sum(len(e.token_ids) for e in seen if e.type == "token")
    with worker_thread(FakeEngine(), url, prefix, claim_idle_ms=600_000, heartbeat_s=0.2):
        res = job.result(timeout=20)
        reader.join(20)
    assert not reader.is_alive()
    want = expected_for_prompt("lost tail", 120)
    assert res.text == want and res.usage.completion_tokens == 120
    rewinds = [e for e in seen if isinstance(e, RewindEvent)]
    assert len(rewinds) == 1, [e.type for e in seen]
    rw = rewinds[0]
    assert (rw.index, rw.token_index) == (0, 20) and rw.dropped >= shown_before - 20 > 0
    assert rw.dropped_text == want[20:20 + rw.dropped]  # what it had shown past the cut
    shown = ""
    for e in seen:
        if isinstance(e, RewindEvent):
            assert shown.endswith(e.dropped_text)
            shown = shown[:len(shown) - len(e.dropped_text)]
        else:
            shown += e.text
    assert shown == want  # a reader that applies the rewind ends with the result's text
    # the durable log reads as one continuous attempt after another: a later reader sees no
    # rewind (the resume goes on after exactly the 20 tokens the log holds)
    assert stream_problems(c, job.id) == []
    assert [e.type for e in c.job(job.id).stream(timeout=5)].count("rewind") == 0
    assert [e.type for e in raw_events(c, job.id)].count("resume") == 1
