"""Prefix-aware routing (issue 21): the pure decision, the Redis index, and hand-offs between
in-process workers on a fake engine that keeps a real prefix-hash bookkeeping (fast, no torch)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from genpool.engine.block_manager import BlockManager, prompt_block_hashes
from genpool.engine.protocol import EngineStats
from genpool.producer import Client
from genpool.schemas import Keys, parse_event
from genpool.schemas.connection import connect
from genpool.schemas.routing import PeerLoad
from genpool.workers.prefix_index import PrefixIndex
from genpool.workers.routing import AFFINITY, FALLBACK, LOAD, Candidate, RouteParams, route
from tests.fake_engine import FakeEngine, expected_for_prompt
from tests.pool_helpers import ROOT, client_env, drop_prefix, new_prefix, wait_for, worker_thread

P = RouteParams(min_gain_tokens=64, max_backlog_jobs=4, default_job_tokens=64)


# -- the decision ------------------------------------------------------------------------------
def test_no_peers_runs_here():
    d = route(800, Candidate("me"), [], False, P)
    assert (d.target, d.how, d.handoff) == ("me", LOAD, False)
    d = route(800, Candidate("me", cached_tokens=784), [], False, P)
    assert (d.target, d.how, d.handoff) == ("me", AFFINITY, False)


def test_goes_to_the_peer_with_the_longest_cached_prefix():
    peers = [Candidate("a", cached_tokens=320), Candidate("b", cached_tokens=784),
             Candidate("c", cached_tokens=0)]
    d = route(800, Candidate("me", cached_tokens=0), peers, False, P)
    assert (d.target, d.how, d.handoff) == ("b", AFFINITY, True)
    assert d.local_cost - d.cost == 784


def test_a_small_gain_stays_local():
    d = route(800, Candidate("me", cached_tokens=736), [Candidate("b", cached_tokens=784)],
              False, P)
    assert (d.target, d.handoff, d.how) == ("me", False, LOAD)  # 48 < 64 tokens saved
    d = route(40, Candidate("me"), [Candidate("b", cached_tokens=32)], False, P)
    assert not d.handoff  # short prompts never move


def test_interactive_jobs_stay_with_their_puller():
    free = Candidate("b", cached_tokens=784, free=2)
    d = route(800, Candidate("me"), [free], True, P)
    assert (d.target, d.how, d.handoff) == ("me", FALLBACK, False)
    d = route(800, Candidate("me", cached_tokens=784), [free], True, P)
    assert (d.target, d.how, d.handoff) == ("me", AFFINITY, False)


def test_interactive_moves_when_allowed_only_to_a_peer_with_a_free_slot():
    p = replace(P, move_interactive=True)
    full = Candidate("b", cached_tokens=784, free=0)
    d = route(800, Candidate("me"), [full], True, p)
    assert (d.target, d.how, d.handoff) == ("me", FALLBACK, False)
    d = route(800, Candidate("me"), [full], False, p)  # batch work may queue there
    assert (d.target, d.how, d.handoff) == ("b", AFFINITY, True)
    d = route(800, Candidate("me"), [Candidate("b", cached_tokens=784, free=2)], True, p)
    assert (d.target, d.handoff) == ("b", True)


def test_a_busy_affine_peer_loses_to_computing_here():
    # (3 queued + 1 for the full engine) x 300 tokens per job over 1 slot = 1200 > 800 - 16
    busy = Candidate("b", cached_tokens=784, free=0, backlog_jobs=3, job_tokens=300)
    d = route(800, Candidate("me"), [busy], False, P)
    assert (d.target, d.handoff, d.how) == ("me", False, LOAD)
    # the same queue over 4 slots drains 4x faster: 300 + 16 < 800, so it waits there
    d = route(800, Candidate("me"), [replace(busy, slots=4)], False, P)
    assert (d.target, d.handoff, d.how) == ("b", True, AFFINITY)


def test_a_full_backlog_takes_nothing():
    capped = Candidate("b", cached_tokens=784, backlog_jobs=P.max_backlog_jobs)
    d = route(800, Candidate("me"), [capped], False, P)
    assert (d.target, d.handoff, d.how) == ("me", False, FALLBACK)


def test_load_moves_work_from_a_backlogged_puller_to_an_idle_peer():
    me = Candidate("me", free=1, backlog_jobs=3, job_tokens=100)
    d = route(200, me, [Candidate("idle", free=4)], False, P)
    assert (d.target, d.how, d.handoff) == ("idle", LOAD, True)


def test_an_unreadable_index_is_a_fallback_and_runs_here():
    d = route(800, Candidate("me"), [Candidate("b", cached_tokens=784)], False, P, index_ok=False)
    assert (d.target, d.how, d.handoff) == ("me", FALLBACK, False)


def test_ties_are_broken_deterministically():
    peers = [Candidate("z", cached_tokens=784), Candidate("a", cached_tokens=784)]
    assert route(800, Candidate("me"), peers, False, P).target == "a"


# -- the hashes --------------------------------------------------------------------------------
def test_prompt_hashes_are_what_the_block_manager_registers():
    bm = BlockManager(64, block_size=4)

    class Seq:
        def __init__(self, ids):
            self.token_ids, self.num_computed_tokens = ids, 0
            self.block_table, self.block_hashes = [], []

        @property
        def num_tokens(self):
            return len(self.token_ids)

    ids = list(range(100, 123))  # 23 tokens: 5 full blocks usable (the last token excluded)
    seq = Seq(ids)
    assert bm.allocate_slots(seq, len(ids))
    hs = prompt_block_hashes(ids, 4)
    assert len(hs) == 5 and hs == seq.block_hashes[:5]
    assert set(hs) <= set(bm.cached_hashes(4096))
    assert bm.cached_hashes(2) == list(bm._hash_to_block)[-2:]
    assert len(bm.find_cached_blocks(ids + [9])) == 5


def test_chain_hashes_agree_across_processes_and_hash_seeds():
    code = ("from genpool.engine.block_manager import prompt_block_hashes as p;"
            "print(p(list(range(7, 60)), 16))")
    outs = {subprocess.run([sys.executable, "-P", "-c", code], cwd=ROOT, capture_output=True, text=True,
                           env=dict(os.environ, PYTHONHASHSEED=seed),
                           check=True).stdout for seed in ("1", "2", "random")}
    assert len(outs) == 1 and outs.pop().strip() == str(prompt_block_hashes(list(range(7, 60)), 16))


# -- the index in Redis ------------------------------------------------------------------------
@pytest.fixture
def rkeys(redis_url):
    prefix = new_prefix("route")
    r = connect(redis_url)
    yield r, Keys(prefix), redis_url, prefix
    r.close()
    drop_prefix(redis_url, prefix)


def test_index_publish_and_lookup(rkeys):
    r, keys, _, _ = rkeys
    a, b = PrefixIndex(r, keys, "a", 0.5), PrefixIndex(r, keys, "b", 0.5)
    chain = prompt_block_hashes(list(range(1000, 1200)), 16)  # 12 blocks
    a.publish(chain[:8], PeerLoad(free=2, backlog=0, block_size=16, model="m"))
    b.publish(chain[:3] + [12345], PeerLoad(free=0, backlog=1, block_size=16, model="m"))
    peers, stale = a.peers()
    assert list(peers) == ["b"] and stale == 0 and peers["b"].backlog == 1
    other = prompt_block_hashes([7] + list(range(1001, 1200)), 16)  # differs in token 0 only
    got = b.cached_tokens(["a", "b"], [chain, other, []], 16)
    assert got[0] == {"a": 128, "b": 48}
    assert got[1] == {"a": 0, "b": 0}  # a chain's hash covers its whole prefix
    assert got[2] == {}
    # by difference: old blocks leave, new ones come, never an empty set in between
    a.publish(chain[4:10], PeerLoad(free=1, backlog=0, block_size=16, model="m"))
    assert r.scard(keys.prefix_index("a")) == 6
    assert b.cached_tokens(["a"], [chain], 16)[0] == {"a": 0}
    for key in (keys.prefix_index("a"), keys.route_load, keys.route_workers):
        assert 0 < r.ttl(key) <= 3600
    a.leave()
    peers, _ = b.peers()
    assert peers == {} and not r.exists(keys.prefix_index("a"))


def test_an_expired_set_is_rewritten_whole(rkeys):
    r, keys, _, _ = rkeys
    a = PrefixIndex(r, keys, "a", 0.5)
    a.publish([1, 2, 3], PeerLoad())
    r.delete(keys.prefix_index("a"))  # expired while the worker was stalled
    a.publish([1, 2, 3], PeerLoad())  # nothing new by difference: it learns the set is gone...
    a.publish([1, 2, 3], PeerLoad())  # ...and rewrites it whole
    assert r.smembers(keys.prefix_index("a")) == {b"1", b"2", b"3"}


def test_a_stale_peer_is_left_out(rkeys):
    r, keys, _, _ = rkeys
    a, b = PrefixIndex(r, keys, "a", 0.2), PrefixIndex(r, keys, "b", 0.2)
    b.publish([1], PeerLoad(free=1))
    assert "b" in a.peers()[0]
    r.zadd(keys.route_workers, {"b": time.time() - 5})  # its last publish: 5 s ago
    assert a.peers() == ({}, 1)


# -- hand-offs between in-process workers (fake engine with prefix bookkeeping) -----------------
class _HashBM:
    """What the router reads of a block manager: block size, cached hashes, lookups."""

    enable_prefix_caching = True

    def __init__(self, block_size: int):
        self.block_size, self.hashes = block_size, {}

    def cached_hashes(self, limit):
        return list(self.hashes)[-limit:]

    def find_cached_blocks(self, ids, hashes=None):
        n = 0
        for h in hashes if hashes is not None else prompt_block_hashes(ids, self.block_size):
            if h not in self.hashes:
                break
            n += 1
        return list(range(n))


class CachingFakeEngine(FakeEngine):
    """FakeEngine whose prompts' blocks become 'cached' when added, with vLLM-style stats."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.block_manager = _HashBM(self.block_size)
        self.queries = self.hits = 0
        self.ran: list[str] = []

    def add_request(self, request_id, prompt, params, priority=0, arrival_time=None,
                    resume=None):
        super().add_request(request_id, prompt, params, priority, arrival_time, resume)
        ids = prompt["prompt_token_ids"]
        self.queries += len(ids)
        self.hits += len(self.block_manager.find_cached_blocks(ids)) * self.block_size
        for h in prompt_block_hashes(ids, self.block_size):
            self.block_manager.hashes[h] = None
        self.ran.append(request_id)

    def stats(self) -> EngineStats:
        from dataclasses import replace

        return replace(super().stats(), prefix_cache_queries=self.queries,
                       prefix_cache_hits=self.hits)


DOC = " ".join(f"line{i} of the shared document" for i in range(40))  # ~1200 fake tokens


def terminal_events(c: Client, job_id: str) -> int:
    evs = [parse_event(f[b"event"] if b"event" in f else f["event"])
           for _, f in c.redis.xrange(c.keys.events(job_id))]
    return sum(e.type in ("result", "error") for e in evs)


@pytest.fixture
def env(redis_url):
    with client_env(redis_url, "rt") as e:
        yield e


@pytest.fixture
def topo_env(topology_url):
    """One server, then a 3-master Redis Cluster (every routing key is in `{<prefix>}`)."""
    with client_env(topology_url, "rt") as e:
        yield e


FAST = dict(prefix_index_s=0.1, heartbeat_s=0.3)


def test_jobs_follow_their_cached_prefix_to_a_peer(topo_env):
    url, prefix, c = topo_env
    # a never runs out of slots, so handing it a job costs no wait (see the wait tests above)
    ea, eb = CachingFakeEngine(max_num_seqs=32), CachingFakeEngine(max_num_seqs=4)
    with worker_thread(ea, url, prefix, name="a", **FAST) as a:
        warm = c.submit(f"{DOC} Q: warm?", max_tokens=2)
        assert warm.result(timeout=10).ok
        with worker_thread(eb, url, prefix, name="b", **FAST) as b:
            # the index lags the cache by up to one publish interval: wait for a's warm blocks
            wait_for(lambda: c.redis.scard(c.keys.prefix_index("a")) >= 70
                     and c.redis.zscore(c.keys.route_workers, "b"), timeout=10,
                     what="both indexes published")
            time.sleep(0.1)
            # which worker's read an entry reaches is a race: a (32 slots) can take a whole
            # round before b's next read on a loaded machine, so send rounds until b has pulled
            # (and handed over) some; every round's jobs must run on a all the same
            for rnd in range(6):
                specs = [dict(prompt=f"{DOC} Q: question {rnd}.{i}?", max_tokens=3)
                         for i in range(16)]
                jobs = c.submit_many(specs)
                for spec, job in zip(specs, jobs):
                    res = job.result(timeout=20)
                    assert res.text == expected_for_prompt(spec["prompt"], 3)
                    assert terminal_events(c, job.id) == 1
                ran_on = {j.id: c.job(j.id).info().get("worker") for j in jobs}
                assert set(ran_on.values()) == {"a"}, ran_on  # b handed over all it pulled
                if b.router.counts["handed_off"] >= 1:
                    break
            assert b.router.counts["handed_off"] >= 1, "b pulled no job in 6 rounds"
            assert a.router.counts["handed_in"] == b.router.counts["handed_off"]
            assert set(eb.ran) == set()  # b's engine computed none of them
            st = b.status()
            assert st.routed_affinity == b.router.counts["handed_off"]
            wait_for(lambda: json.loads(c.redis.hget(c.keys.workers, "a"))["handed_in"] >= 1,
                     timeout=5, what="heartbeat carries the counters")


def test_routing_off_keeps_jobs_where_they_were_pulled(env):
    url, prefix, c = env
    ea, eb = CachingFakeEngine(max_num_seqs=2), CachingFakeEngine(max_num_seqs=2)
    with worker_thread(ea, url, prefix, name="a", prefix_routing=False, **FAST), \
            worker_thread(eb, url, prefix, name="b", prefix_routing=False, **FAST) as b:
        jobs = c.submit_many([dict(prompt=f"{DOC} Q: {i}?", max_tokens=2) for i in range(6)])
        assert all(j.result(timeout=20).ok for j in jobs)
        assert b.router.counts["handed_off"] == 0 and not c.redis.exists(c.keys.route_workers)


def test_a_ghost_in_the_index_does_not_strand_jobs(env):
    """A fresh index entry for a worker that is gone (killed between publishes): jobs handed to
    it sit in its PEL until the usual reclaim, then run exactly once elsewhere."""
    url, prefix, c = env
    r, keys = c.redis, Keys(prefix)
    eng = CachingFakeEngine(max_num_seqs=4)
    chain = prompt_block_hashes(eng.tokenizer(f"{DOC} Q: x?")["input_ids"], 16)
    ghost = PrefixIndex(r, keys, "ghost", 30.0)  # claims to be fresh for 90 s
    ghost.publish(chain[:-2], PeerLoad(free=4, backlog=0, block_size=16, model="fake"))
    with worker_thread(eng, url, prefix, name="live", claim_idle_ms=1500, **FAST) as w:
        specs = [dict(prompt=f"{DOC} Q: {i}?", max_tokens=2) for i in range(5)]
        t0 = time.monotonic()
        jobs = c.submit_many(specs)
        for spec, job in zip(specs, jobs):
            assert job.result(timeout=30).text == expected_for_prompt(spec["prompt"], 2)
            assert terminal_events(c, job.id) == 1
        assert w.router.counts["handed_off"] == 5  # all went to the ghost first...
        assert time.monotonic() - t0 >= 1.0  # ...and came back through XAUTOCLAIM
        assert {c.job(j.id).info().get("worker") for j in jobs} == {"live"}
    ghost.leave()


def test_a_stopping_worker_gives_its_backlog_to_a_peer(env):
    url, prefix, c = env
    lane = Keys(prefix).jobs("normal")
    ea, eb = CachingFakeEngine(max_num_seqs=1, step_delay=0.05), CachingFakeEngine(max_num_seqs=4)
    with worker_thread(ea, url, prefix, name="a", drain_timeout_s=5.0, **FAST) as a:
        x = c.submit("p x", max_tokens=30)
        wait_for(lambda: x.id in a.jobs.running, what="a busy (no slot left)")
        for e in ("y", "z"):  # stand-ins for jobs peers handed a while it is full
            eid = c.redis.xadd(lane, {"job": json.dumps({"id": f"j{e}", "prompt": f"p {e}",
                                                         "max_tokens": 3})})
            assert c.redis.xreadgroup("workers", "tmp", {lane: ">"}, count=1)
            c.redis.xclaim(lane, "workers", "a", 0, [eid], justid=True)
        wait_for(lambda: a.router.counts["handed_in"] == 2, what="a holds its hand-offs")
        assert a.router.waiting == 2 and x.id in a.jobs.running
        with worker_thread(eb, url, prefix, name="b", **FAST) as b:
            wait_for(lambda: c.redis.zscore(c.keys.route_workers, "b"), what="b in the index")
            a.stop()  # finishes its one running job; the backlog goes to b
            assert x.result(timeout=20).ok
            for e in "yz":
                res = c.job(f"j{e}").result(timeout=20)
                assert res.ok and res.worker == "b" and terminal_events(c, f"j{e}") == 1
            assert b.router.counts["handed_in"] == 2


def keys_normal(prefix: str) -> str:
    return Keys(prefix).jobs("normal")
