"""Grammar compiles shared fairly (issue 28, item 10): a small grammar never times out behind big
ones, the time limit counts from a compile's start, and the cache is bounded by estimated bytes.

Real llguidance compiles with the tiny tokenizer (no model): StructuredOutputs is driven the way
the engine drives it (track on add_request, poll each step). Sizes are scaled down from the
report (30 schemas of ~970 KB) to a dozen ~170 KB ones, the limit calibrated on this machine so
the backlog of big compiles is at least twice the time limit.
"""
from __future__ import annotations

import time

import pytest

from genpool.engine.sampling_params import SamplingParams
from genpool.engine.sequence import Sequence
from genpool.engine.structured import StructuredOutputs
from genpool.engine.tokenizer import load_tokenizer
from tests.tiny_tokenizer import VOCAB_SIZE

SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def wide(n: int, salt: int) -> dict:
    """A distinct ~55 chars/field schema; 3000 fields (~170 KB) compile in ~0.15 s here."""
    return {"type": "object", "properties": {f"s{salt}f{i}": {"type": "string",
                                                               "pattern": f"[a-z]{{{i % 7 + 1}}}x"}
                                             for i in range(n)}}


@pytest.fixture
def so(tiny_tokenizer_path):
    out = StructuredOutputs(load_tokenizer(tiny_tokenizer_path), VOCAB_SIZE, 2)
    yield out
    out.close()


def seq(rid: str, schema: dict) -> Sequence:
    return Sequence(rid, [1, 2, 3], SamplingParams(structured_outputs={"json": schema}))


def settle(so: StructuredOutputs, seqs: list[Sequence], timeout: float = 60,
           failed: dict[str, str] | None = None) -> dict[str, str]:
    """Poll as the engine's step loop does until every sequence has a matcher or failed."""
    failed = {} if failed is None else failed
    deadline = time.monotonic() + timeout
    while so.pending and time.monotonic() < deadline:
        failed.update(so.poll())
        so.wait_pending(0.01)
    assert not so.pending, "compiles did not settle"
    assert all(s.matcher is not None or s.request_id in failed for s in seqs)
    return failed


def test_a_small_grammar_never_times_out_behind_big_ones(so):
    warm = seq("warm", {"type": "string"})  # builds llguidance's tokenizer, once
    so.track(warm)
    settle(so, [warm])
    first = seq("calibrate", wide(3000, -1))
    t0 = time.monotonic()
    so.track(first)
    settle(so, [first])
    t_big = time.monotonic() - t0
    so.compile_timeout_s = 3 * t_big  # one big compile alone fits its limit three times over
    bigs = [seq(f"big{i}", wide(3000, i)) for i in range(12)]  # backlog >= 6 x t_big, 2 threads
    for s in bigs:
        so.track(s)
    compiles = {s.request_id: so.pending[s] for s in bigs}
    small = seq("small", SMALL)
    so.track(small)  # sent after the big ones, as the 90-character schema of the report
    t_small, failed = time.monotonic(), {}
    while small.matcher is None and "small" not in failed:
        assert time.monotonic() - t_small < 2 * so.compile_timeout_s, "small grammar still waiting"
        failed.update(so.poll())
        so.wait_pending(0.01)
    assert "small" not in failed, failed["small"]
    waited = time.monotonic() - t_small
    settle(so, bigs, failed=failed)
    assert waited < 1.5 * t_big + 0.05, f"the small grammar waited {waited:.2f} s behind big ones"
    for rid in failed:  # a big one fails only when its own compile ran past the limit
        took = compiles[rid].result(timeout=60).compile_s
        assert took > 0.9 * so.compile_timeout_s, (rid, took, failed[rid])


def test_cache_is_bounded_by_estimated_bytes_and_floods_keep_small_hot_grammars(
        tiny_tokenizer_path):
    # 64 MiB: the big lane's share holds about 5 of these ~9 MB (estimated) grammars, not 10
    so = StructuredOutputs(load_tokenizer(tiny_tokenizer_path), VOCAB_SIZE, 2,
                           cache_bytes=64 << 20)
    cache = so.cache
    hot = seq("hot", SMALL)
    so.track(hot)
    settle(so, [hot])
    bigs = [seq(f"flood{i}", wide(2000, 100 + i)) for i in range(10)]
    budget = cache.lanes["big"].max_bytes
    for s in bigs:
        so.track(s)
    settle(so, bigs)
    usage = cache.usage()
    assert usage["big"]["bytes"] <= budget, usage
    assert usage["big"]["entries"] < len(bigs), usage  # the oldest were evicted
    assert usage["big"]["bytes"] + usage["small"]["bytes"] <= cache.max_bytes
    hits = cache.hits
    again = seq("hot-again", SMALL)
    so.track(again)
    settle(so, [again])
    assert cache.hits == hits + 1  # the big flood did not evict the small hot grammar
    so.close()


def test_big_backlog_is_bounded_and_abandoned_compiles_never_run(so):
    """Past the big lane's backlog a new big compile is refused at once (retryable: the refusal
    is not cached), and a queued compile whose every request went away is never run."""
    import threading

    from genpool.engine.sequence import SequenceStatus

    warm = seq("warm", {"type": "string"})
    so.track(warm)
    settle(so, [warm])
    lane = so.cache.lanes["big"]
    gate = threading.Event()
    for _ in range(2):  # both big-lane threads busy: what two long compiles do
        lane.pool.submit(gate.wait, 30)
    specs = [wide(2000, 200 + i) for i in range(5)]
    size = len(SamplingParams(structured_outputs={"json": specs[0]}).structured_outputs.key[1])
    lane.max_queued_chars = 2 * size  # two may wait
    seqs = [seq(f"q{i}", s) for i, s in enumerate(specs)]
    for s in seqs:
        so.track(s)
    seqs[1].status = SequenceStatus.FINISHED  # aborted while its compile waits
    failed = dict(so.poll())  # q1 is let go before any thread is free
    assert sorted(failed) == ["q2", "q3", "q4"], failed
    assert all("retry later" in err for err in failed.values()), failed
    compiled = so.cache.stats()["grammar_compiles"]
    gate.set()
    settle(so, [seqs[0]])
    lane.pool.submit(lambda: None).result(10)  # whatever was queued has run (or was cancelled)
    assert so.cache.stats()["grammar_compiles"] == compiled + 1, "the abandoned compile ran"
    assert so.cache.usage()["big"]["queued_chars"] == 0
    again = seq("retry", specs[2])
    so.track(again)
    assert not settle(so, [again]) and again.matcher is not None  # the refusal was not cached
