"""Peers' routing data is untrusted input (issue 28, item 8): one malformed load summary in
`<p>:route:{<p>}:load` must cost only that peer, never the worker that reads it."""
from __future__ import annotations

import json
import logging
import time

from genpool.engine.block_manager import prompt_block_hashes
from genpool.schemas import Keys
from genpool.schemas.routing import PeerLoad
from genpool.workers.prefix_index import PrefixIndex
from tests.fake_engine import expected_for_prompt
from tests.pool_helpers import wait_for, worker_thread
from tests.worker.test_routing import DOC, FAST, CachingFakeEngine, env, rkeys  # noqa: F401

BAD = {"free": "plenty", "backlog": 0, "slots": 4, "job_tokens": 10, "block_size": 16,
       "model": "fake"}


def plant(r, keys: Keys, name: str, doc) -> None:
    """A routing entry written by something other than a genpool worker: raw HSET + ZADD."""
    r.hset(keys.route_load, name, doc if isinstance(doc, str) else json.dumps(doc))
    r.zadd(keys.route_workers, {name: time.time() + 60})  # fresh for the next minute
    r.expire(keys.route_load, 600)
    r.expire(keys.route_workers, 600)


def test_a_malformed_peer_is_skipped_and_warned_about_once(rkeys, caplog):
    r, keys, _, _ = rkeys
    a, b = PrefixIndex(r, keys, "a", 0.5), PrefixIndex(r, keys, "b", 0.5)
    b.publish([1], PeerLoad(free=2, backlog=0, slots=2, block_size=16, model="m"))
    plant(r, keys, "ghost", BAD)
    plant(r, keys, "junk", "not json {")
    plant(r, keys, "nan", dict(BAD, free=1, job_tokens=float("nan")))
    caplog.set_level(logging.WARNING, "genpool.worker")
    for _ in range(3):
        peers, unusable = a.peers()
        assert list(peers) == ["b"] and unusable == 3
        assert peers["b"].free == 2 and peers["b"].slots == 2  # typed, not raw JSON
    plant(r, keys, "ghost", dict(BAD, at=time.time()))  # a buggy peer publishing again
    a.peers()
    warned = [m for m in caplog.messages if "routing entry" in m]
    assert len(warned) == 3, warned  # once per bad peer, not once per read or publish
    assert any("ghost" in m and "free" in m for m in warned)
    plant(r, keys, "ghost", dict(BAD, free=3))  # it mends: used again, and a relapse is news
    assert a.peers()[0]["ghost"].free == 3
    plant(r, keys, "ghost", BAD)
    a.peers()
    assert len([m for m in caplog.messages if "ghost" in m]) == 2


def test_a_malformed_peer_does_not_kill_the_worker_that_routes(env, caplog):
    url, prefix, c = env
    r, keys = c.redis, Keys(prefix)
    eng = CachingFakeEngine(max_num_seqs=4)
    chain = prompt_block_hashes(eng.tokenizer(f"{DOC} Q: x?")["input_ids"], 16)
    r.sadd(keys.prefix_index("ghost"), *chain)  # it "caches" the document: jobs would go there
    r.expire(keys.prefix_index("ghost"), 600)
    plant(r, keys, "ghost", BAD)
    caplog.set_level(logging.WARNING, "genpool.worker")
    with worker_thread(eng, url, prefix, name="live", **FAST) as w:
        specs = [dict(prompt=f"{DOC} Q: {i}?", max_tokens=2) for i in range(4)]
        for spec in specs:  # one at a time: every job is routed on its own
            job = c.submit(**spec)
            assert job.result(timeout=15).text == expected_for_prompt(spec["prompt"], 2)
        assert not w.stopping and w.router.counts["handed_off"] == 0
        assert sum(w.router.counts[k] for k in ("routed_load", "routed_fallback",
                                                 "routed_affinity")) == 4
    wait_for(lambda: caplog.messages, what="a warning")
    assert len([m for m in caplog.messages if "ghost" in m]) == 1
