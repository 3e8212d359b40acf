"""schemas/scripting.py on real servers: a Script loads itself only when a server lacks it, a
pipeline resends exactly the calls answered NoScriptError, and a Cluster gets EVAL.

The shared Redis is never flushed: SCRIPT FLUSH runs on a redis-server of this module's own
(tests/redis_topologies.py starts it and kills it with the test process)."""
from __future__ import annotations

import asyncio
import tempfile
import uuid
from pathlib import Path

import pytest
import redis
import redis.asyncio as aredis

from genpool.schemas.connection import connect, connect_async
from genpool.schemas.scripting import Script, apipelined, pipelined
from tests.pool_helpers import drop_prefix, new_prefix

TTL_S = 60


def set_get() -> Script:
    """SET KEYS[1] ARGV[1] (with a TTL), answer GET: a body of its own per test (a comment makes
    its SHA new), so no earlier load on the shared server can hide a missing one."""
    return Script(f"-- {uuid.uuid4().hex}\nredis.call('SET', KEYS[1], ARGV[1], 'EX', {TTL_S})\n"
                  "return redis.call('GET', KEYS[1])")


FAIL = Script("return redis.error_reply('NOPE refused on purpose')")


@pytest.fixture
def shared(redis_url):
    prefix = new_prefix("script")
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    yield r, prefix
    r.close()
    drop_prefix(redis_url, prefix)


@pytest.fixture(scope="module")
def private_url():
    """A redis-server of this module's own: the one a test may SCRIPT FLUSH."""
    from tests.redis_topologies import DATA_PORTS, Servers, TopologyUnavailable, free_ports

    servers = Servers(Path(tempfile.mkdtemp(prefix="genpool-script-", dir="/tmp")))
    try:
        port = free_ports(1, DATA_PORTS)[0]
        servers.start(port)
    except (TopologyUnavailable, OSError) as e:
        servers.stop()
        pytest.skip(f"no private redis-server here: {e}")
    yield f"redis://127.0.0.1:{port}/0"
    servers.stop()


def test_an_immediate_call_loads_the_script_once(shared):
    r, prefix = shared
    sc = set_get()
    assert r.script_exists(sc.sha) == [False]  # nothing is loaded up front
    assert sc(r, [f"{prefix}:a"], ["1"]) == "1"
    assert r.script_exists(sc.sha) == [True]
    assert sc(r, [f"{prefix}:a"], ["2"]) == "2"  # EVALSHA now, no reload
    assert r.ttl(f"{prefix}:a") > 0


def test_a_pipeline_answers_in_order_with_errors_as_values(shared):
    r, prefix = shared
    sc = set_get()
    items = [(sc, f"{prefix}:k{i}", str(i)) for i in range(5)] + [(FAIL, f"{prefix}:x", "")]
    res = pipelined(r, items, lambda pipe, it: it[0].queue(pipe, [it[1]], [it[2]]), [sc, FAIL])
    assert res[:5] == ["0", "1", "2", "3", "4"]
    assert isinstance(res[5], redis.ResponseError) and "NOPE" in str(res[5])
    with pytest.raises(redis.ResponseError, match="NOPE"):
        pipelined(r, items, lambda pipe, it: it[0].queue(pipe, [it[1]], [it[2]]), [sc, FAIL],
                  raise_errors=True)
    assert pipelined(r, [], lambda pipe, it: None) == []


def test_after_script_flush_each_call_reloads_and_nothing_runs_twice(private_url):
    r = redis.Redis.from_url(private_url, decode_responses=True)
    sc = set_get()
    assert sc(r, ["a"], ["1"]) == "1"
    r.script_flush()
    assert sc(r, ["a"], ["2"]) == "2"  # NoScriptError, SCRIPT LOAD, sent again
    r.script_flush()
    items = [("script", "b", "3"), ("incr", "n", ""), ("script", "c", "4")]

    def queue(pipe, it):
        if it[0] == "incr":
            pipe.incr(it[1])
        else:
            sc.queue(pipe, [it[1]], [it[2]])

    assert pipelined(r, items, queue, [sc]) == ["3", 1, "4"]
    assert r.get("n") == "1"  # only the calls answered NoScriptError were sent again
    r.close()


def test_asyncio_calls_reload_too(private_url):
    async def main():
        r = aredis.Redis.from_url(private_url, decode_responses=True)
        sc = set_get()
        await r.script_flush()
        assert await sc.acall(r, ["aa"], ["1"]) == "1"
        await r.script_flush()
        res = await apipelined(r, ["x", "y"], lambda pipe, k: sc.queue(pipe, [k], [k * 2]), [sc])
        assert res == ["xx", "yy"]
        await r.aclose()

    asyncio.run(main())


def test_a_cluster_runs_scripts_with_eval(cluster_url):
    prefix = new_prefix("script")
    r = connect(cluster_url, decode_responses=True)
    sc = set_get()
    try:
        keys = [f"{prefix}:{{{i}}}" for i in range(6)]  # several hash slots, so several nodes
        assert sc(r, [keys[0]], ["v"]) == "v"
        res = pipelined(r, keys, lambda pipe, k: sc.queue(pipe, [k], [k]), [sc])
        assert res == keys  # redis-py's cluster pipeline refuses EVALSHA: the body went with EVAL

        async def aio():
            ar = connect_async(cluster_url, decode_responses=True)
            got = await apipelined(ar, keys, lambda pipe, k: sc.queue(pipe, [k], ["a"]), [sc])
            one = await sc.acall(ar, [keys[1]], ["b"])
            await ar.aclose()
            return got, one

        assert asyncio.run(aio()) == (["a"] * 6, "b")
    finally:
        r.close()
        drop_prefix(cluster_url, prefix)
