"""A wait's timeout holds while Redis stalls: a server that keeps its connections but answers
nothing (here a SIGSTOPped redis-server) must not hold `result(timeout=...)` far past it."""
from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest
import redis

from genpool.producer import Client, QueueUnavailable
from genpool.producer.aio import AsyncClient
from genpool.producer.pipeline import map_prompts
from genpool.schemas.connection import connect, connect_async
from tests.redis_topologies import binary
from tests.worker.refusal_helpers import private_server


@pytest.fixture
def stalled(tmp_path):
    """(url, stall, resume): a private redis-server; stall() SIGSTOPs it, resume() SIGCONTs."""
    server = binary("redis-server")
    if server is None:
        pytest.skip("no redis-server binary")
    with private_server(server, tmp_path / "redis") as url:
        pid = int(redis.Redis.from_url(url).info("server")["process_id"])
        try:
            yield url, lambda: os.kill(pid, signal.SIGSTOP), lambda: os.kill(pid, signal.SIGCONT)
        finally:
            os.kill(pid, signal.SIGCONT)  # a test that failed while it was stopped


def test_sync_result_timeout_holds_while_redis_stalls(stalled):
    url, stall, resume = stalled
    # a 2 s socket timeout: each attempt on the stalled server fails after 2 s, so a wait that
    # retried its first read 8 times (as it did) took ~21 s against a timeout of 1 s
    c = Client(url, "st", redis_client=connect(url, decode_responses=True, socket_timeout=2))
    job = c.submit("x", max_tokens=2)
    stall()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as err:
        job.result(timeout=1)
    took = time.monotonic() - t0
    resume()
    assert took < 5, f"result(timeout=1) took {took:.1f} s while Redis stalled"
    assert not isinstance(err.value, QueueUnavailable)
    assert "Redis at" in str(err.value) and "has not answered" in str(err.value), err.value
    c.close()


def test_async_result_timeout_holds_while_redis_stalls(stalled):
    url, stall, resume = stalled

    async def go():
        # the default 30 s socket timeout: only the wait's own deadline can end an attempt
        c = AsyncClient(url, "st", redis_client=connect_async(url, decode_responses=True))
        job = await c.submit("x", max_tokens=2)
        stall()
        t0 = time.monotonic()
        with pytest.raises(TimeoutError) as err:
            await job.result(timeout=1)
        took = time.monotonic() - t0
        resume()
        assert took < 5, f"result(timeout=1) took {took:.1f} s while Redis stalled"
        assert "has not answered" in str(err.value), err.value
        await c.redis.aclose()

    asyncio.run(go())


def test_a_short_stall_within_the_timeout_is_ridden_out(stalled):
    url, stall, resume = stalled
    c = Client(url, "st", redis_client=connect(url, decode_responses=True, socket_timeout=1))
    job = c.submit("x", max_tokens=2)
    stall()
    threading.Timer(1.5, resume).start()
    # no worker here: the wait ends at its timeout (NoWorkers), with Redis answering by then
    with pytest.raises(TimeoutError) as err:
        job.result(timeout=6)
    assert "has not answered" not in str(err.value), err.value
    c.close()


def test_map_timeout_holds_while_redis_stalls(stalled):
    url, stall, resume = stalled
    c = Client(url, "st", redis_client=connect(url, decode_responses=True, socket_timeout=2))
    # its jobs are queued (no worker) before the stall; then every poll meets a silent Redis
    threading.Timer(0.3, stall).start()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as err:
        map_prompts(c, ["a", "b"], max_tokens=2, timeout=1.5)
    took = time.monotonic() - t0
    resume()
    assert took < 6, f"map(timeout=1.5) took {took:.1f} s while Redis stalled"
    assert "has not answered" in str(err.value) and url in str(err.value), err.value
    c.close()
