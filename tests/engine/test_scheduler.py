"""Exact-behaviour tests for the V1-style scheduler over a small BlockManager (no torch).

`Sim` plays the engine's model and sampler: after schedule() it picks a token for every sequence in
out.sampling (and for the n > 1 children it forks) and hands them to Scheduler.update, which owns
the bookkeeping (computed tokens, forks, appending, finishing at params.max_tokens). It also keeps a model of the KV cache (slot -> the token prefix whose K/V sits there) and checks,
every step, that each scheduled sequence attends only to slots holding ITS prefix: that catches
stale prefix-cache entries, missing copy-on-write and blocks read before anyone wrote them.
"""
from __future__ import annotations

import random
import zlib

import pytest

from genpool.engine.block_manager import BlockManager
from genpool.engine.sampling_params import SamplingParams
from genpool.engine.scheduler import SampledToken, Scheduler
from genpool.engine.sequence import Sequence, SequenceStatus

BS = 4


def mkseq(rid: str, prompt, priority: int = 0, arrival: float = 0.0, max_tokens: int = 1000):
    if isinstance(prompt, int):  # n distinct tokens derived from the request id
        base = zlib.crc32(rid.encode()) % 4000
        prompt = [base + i for i in range(prompt)]
    return Sequence(rid, list(prompt), SamplingParams(max_tokens=max_tokens), priority, arrival)


def make(num_blocks=64, max_num_seqs=8, budget=64, caching=True) -> Sim:
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=caching)
    return Sim(Scheduler(bm, max_num_seqs, budget))


def ids(out) -> list[tuple[str, int]]:
    return [(s.request_id, n) for s, n in out.scheduled]


class Sim:
    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.bm = sched.bm
        self.kv: dict[int, tuple[int, ...]] = {}
        self.forks: dict[int, int] = {}  # seq_id -> children to fork when its prompt is done
        self.log: list[list[tuple[str, int]]] = []
        self.forked = False

    def add(self, *seqs: Sequence) -> None:
        for s in seqs:
            self.sched.add(s)

    def _slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // BS] * BS + pos % BS

    def check_kv(self, out) -> None:
        """Copies first, then this step's writes; every scheduled row must read its own prefix."""
        kv = dict(self.kv)
        for src, dst in out.block_copies:
            for o in range(BS):
                if src * BS + o in self.kv:
                    kv[dst * BS + o] = self.kv[src * BS + o]
                else:
                    kv.pop(dst * BS + o, None)
        writes: dict[int, tuple[int, ...]] = {}
        for seq, n in out.scheduled:
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                content = tuple(seq.token_ids[:pos + 1])
                assert writes.setdefault(self._slot(seq, pos), content) == content, \
                    f"two sequences write different K/V into one slot ({seq})"
        kv.update(writes)
        for seq, n in out.scheduled:
            for pos in range(seq.num_computed_tokens + n):
                assert kv.get(self._slot(seq, pos)) == tuple(seq.token_ids[:pos + 1]), \
                    f"{seq} would attend to wrong/unwritten K/V at position {pos}"
        self.kv = kv

    def step(self):
        sched = self.sched
        was_waiting = {s.seq_id for s in sched.waiting}
        out = sched.schedule()
        assert out.num_batched_tokens <= sched.max_num_batched_tokens
        # forked children join the running set directly (they may overrun max_num_seqs), but
        # nothing is admitted from the waiting queue beyond it
        if not self.forked or any(s.seq_id in was_waiting for s, _ in out.scheduled):
            assert len(sched.running) <= sched.max_num_seqs
        assert len({s.seq_id for s, _ in out.scheduled}) == len(out.scheduled)
        assert all(n >= 1 for _, n in out.scheduled)
        assert all(s.status == SequenceStatus.RUNNING for s, _ in out.scheduled)
        self.check_kv(out)
        sampled = []
        for seq in out.sampling:
            sampled.append(SampledToken(seq, self.token(seq)))
            for i in range(self.forks.pop(seq.seq_id, 0)):
                child = seq.fork(i + 1)
                sampled.append(SampledToken(child, self.token(child), fork_of=seq))
                self.forked = True
        sched.update(out, sampled)
        self.check_refcounts()
        self.log.append(ids(out))
        return out

    @staticmethod
    def token(seq: Sequence) -> int:
        return 1000 + 100 * seq.index + seq.num_output_tokens

    def check_refcounts(self) -> None:
        expect = [0] * self.bm.num_blocks
        for s in self.sched.running:
            for b in s.block_table:
                expect[b] += 1
        assert [b.ref_count for b in self.bm.blocks] == expect
        assert all(not s.block_table for s in self.sched.waiting)
        assert self.bm.num_used_blocks == sum(1 for r in expect if r)

    def run(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return
            self.step()
        raise AssertionError("scheduler did not drain")


def test_constructor_rejects_bad_limits():
    bm = BlockManager(4, BS)
    with pytest.raises(ValueError):
        Scheduler(bm, 0, 16)
    with pytest.raises(ValueError):
        Scheduler(bm, 4, 0)


# -- token budget / chunked prefill ----------------------------------------------------------
def test_chunked_prefill_of_a_long_prompt():
    sim = make(budget=32)
    s = mkseq("s", 100, max_tokens=2)
    sim.add(s)
    computed = []
    for _ in range(4):
        sim.step()
        computed.append(s.num_computed_tokens)
    assert sim.log == [[("s", 32)], [("s", 32)], [("s", 32)], [("s", 4)]]
    assert computed == [32, 64, 96, 100]
    assert s.num_output_tokens == 1  # only the last chunk samples
    assert len(s.block_table) == 25
    sim.step()
    assert sim.log[-1] == [("s", 1)]
    assert s.is_finished and s.finish_reason == "length"
    assert not sim.sched.has_unfinished()
    assert sim.bm.num_free_blocks == 64


def test_chunked_prefill_shares_the_budget_with_decodes():
    sim = make(budget=32)
    d = mkseq("d", 4, arrival=0)
    sim.add(d)
    sim.step()
    long = mkseq("L", 100, arrival=1, max_tokens=2)
    sim.add(long)
    for _ in range(5):
        sim.step()
    assert sim.log == [
        [("d", 4)],
        [("d", 1), ("L", 31)],
        [("d", 1), ("L", 31)],
        [("d", 1), ("L", 31)],
        [("d", 1), ("L", 7)],
        [("d", 1), ("L", 1)],
    ]
    assert long.is_finished and d.num_output_tokens == 6


def test_new_prompts_fill_what_running_sequences_leave_of_the_budget():
    sim = make(budget=16)
    sim.add(mkseq("a", 10, arrival=0), mkseq("b", 10, arrival=1), mkseq("c", 10, arrival=2))
    for _ in range(3):
        sim.step()
    assert sim.log == [
        [("a", 10), ("b", 6)],
        [("a", 1), ("b", 4), ("c", 10)],
        [("a", 1), ("b", 1), ("c", 1)],
    ]


def test_max_num_seqs_is_respected():
    sim = make(max_num_seqs=2)
    a, b, c = (mkseq(r, 4, arrival=i, max_tokens=2) for i, r in enumerate("abc"))
    sim.add(a, b, c)
    sim.step()
    assert sim.log[-1] == [("a", 4), ("b", 4)]
    assert sim.sched.running == [a, b] and sim.sched.waiting == [c]
    sim.step()  # a and b finish
    assert sim.log[-1] == [("a", 1), ("b", 1)]
    assert a.is_finished and b.is_finished
    sim.step()
    assert sim.log[-1] == [("c", 4)]
    sim.run()
    assert c.num_output_tokens == 2


# -- priority ----------------------------------------------------------------------------------
def test_waiting_queue_orders_by_priority_then_arrival():
    sim = make(max_num_seqs=1)
    seqs = [mkseq("a", 4, priority=5, arrival=0), mkseq("b", 4, priority=0, arrival=1),
            mkseq("c", 4, priority=0, arrival=2), mkseq("d", 4, priority=-1, arrival=3),
            mkseq("e", 4, priority=5, arrival=4), mkseq("f", 4, priority=0, arrival=1)]
    for s in seqs:
        s.params.max_tokens = 1
    sim.add(*seqs)
    order = ["d", "b", "f", "c", "a", "e"]  # f ties b on arrival: creation order decides
    assert [s.request_id for s in sim.sched.waiting] == order
    sim.run()
    assert sim.log == [[(r, 4)] for r in order]
    assert sim.sched.num_preemptions == 0


def test_equal_priority_waiting_request_does_not_preempt():
    sim = make(max_num_seqs=1)
    a = mkseq("a", 4, priority=3, arrival=0, max_tokens=3)
    sim.add(a)
    sim.step()
    b = mkseq("b", 4, priority=3, arrival=1, max_tokens=1)
    sim.add(b)
    out = sim.step()
    assert ids(out) == [("a", 1)] and out.preempted == []
    sim.run()
    assert sim.log[2:] == [[("a", 1)], [("b", 4)]]
    assert sim.sched.num_preemptions == 0


def test_high_priority_request_preempts_when_seats_are_full():
    sim = make(max_num_seqs=1, budget=16)
    low = mkseq("low", 4, priority=5, arrival=0, max_tokens=4)
    sim.add(low)
    sim.step()
    sim.step()
    assert low.num_tokens == 6 and low.num_computed_tokens == 5
    high = mkseq("high", 4, priority=0, arrival=1, max_tokens=1)
    sim.add(high)
    out = sim.step()
    assert ids(out) == [("high", 4)]  # low's decode slot was taken back (refunded)
    assert out.preempted == [low]
    assert low.status == SequenceStatus.WAITING and sim.sched.waiting == [low]
    assert low.block_table == [] and low.num_computed_tokens == 0
    assert low.num_preemptions == 1 and sim.sched.num_preemptions == 1
    assert high.is_finished
    out = sim.step()  # low recomputes; its full prompt block comes back from the prefix cache
    assert ids(out) == [("low", 2)]
    assert low.block_table[0] == 0 and low.num_computed_tokens == 6
    sim.run()
    assert low.output_token_ids == [1000, 1001, 1002, 1003]
    assert sim.bm.num_free_blocks == sim.bm.num_blocks


def test_high_priority_request_preempts_when_blocks_are_full():
    sim = make(num_blocks=6, budget=64)
    low = mkseq("low", 12, priority=5, arrival=0, max_tokens=5)
    sim.add(low)
    sim.step()
    sim.step()
    assert low.block_table == [0, 1, 2, 3] and low.num_computed_tokens == 13
    high = mkseq("high", 12, priority=0, arrival=1, max_tokens=1)
    sim.add(high)
    out = sim.step()
    assert ids(out) == [("high", 12)] and out.preempted == [low]
    # high took the never-hashed blocks first: low's computed prompt blocks 0..2 stay cached
    assert sim.bm.find_cached_blocks(low.token_ids) == [0, 1, 2]
    assert low.num_computed_tokens == 0 and low.block_table == []
    out = sim.step()  # high finished: low comes back, its three full prompt blocks from the cache
    assert ids(out) == [("low", 2)]
    assert low.block_table[:3] == [0, 1, 2] and low.num_computed_tokens == 14
    sim.run()
    assert low.is_finished and low.num_output_tokens == 5


# -- preemption by recompute -------------------------------------------------------------------
def test_preemption_by_recompute_when_blocks_run_out():
    sim = make(num_blocks=4, caching=False)
    a = mkseq("a", 6, arrival=0, max_tokens=8)
    b = mkseq("b", 6, arrival=1, max_tokens=8)
    sim.add(a, b)
    for _ in range(3):
        sim.step()
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    b_tokens = list(b.token_ids)
    out = sim.step()  # a needs a third block: b (latest) is preempted
    assert ids(out) == [("a", 1)] and out.preempted == [b]
    assert a.block_table == [0, 1, 3]  # b's tail block, freed first
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert b.status == SequenceStatus.WAITING and sim.sched.waiting == [b]
    assert b.token_ids == b_tokens  # generated tokens kept: they are recomputed
    assert (b.num_preemptions, sim.sched.num_preemptions) == (1, 1)
    sim.run()
    assert sim.log == ([[("a", 6), ("b", 6)]] + [[("a", 1), ("b", 1)]] * 2 + [[("a", 1)]] * 5
                       + [[("b", 9)]] + [[("b", 1)]] * 4)
    assert a.output_token_ids == b.output_token_ids == list(range(1000, 1008))
    assert sim.bm.num_free_blocks == 4


def test_preemption_takes_lowest_priority_then_latest_arrival():
    sim = make(num_blocks=3)
    a = mkseq("a", 4, priority=0, arrival=2, max_tokens=3)
    b = mkseq("b", 4, priority=1, arrival=0, max_tokens=3)
    c = mkseq("c", 4, priority=0, arrival=1, max_tokens=3)
    sim.add(a, b, c)
    out = sim.step()
    assert ids(out) == [("c", 4), ("a", 4), ("b", 4)]
    out = sim.step()  # every sequence now needs a second block; none is free
    assert out.preempted == [b, a]  # a gives up its own seat: no one worse is left
    assert ids(out) == [("c", 1)]
    sim.run()
    assert all(s.is_finished and s.num_output_tokens == 3 for s in (a, b, c))
    assert sim.sched.num_preemptions >= 2
    assert sim.bm.num_free_blocks == 3


def test_preempted_scheduled_sequence_leaves_no_uncomputed_block_in_the_cache():
    # low is scheduled (its block 2 registered) and then preempted in the same step, so block
    # 2's K/V is never written: nothing may serve it later.
    sim = make(max_num_seqs=1, budget=8)
    low = mkseq("low", 12, priority=5, arrival=0, max_tokens=2)
    sim.add(low)
    sim.step()
    assert sim.log == [[("low", 8)]] and low.block_table == [0, 1]
    high = mkseq("high", 4, priority=0, arrival=1, max_tokens=1)
    sim.add(high)
    out = sim.step()
    assert ids(out) == [("high", 4)] and out.preempted == [low]
    assert sim.bm.find_cached_blocks(low.prompt_token_ids + [7]) == [0, 1]
    out = sim.step()
    assert ids(out) == [("low", 4)] and low.num_computed_tokens == 12
    sim.run()
    assert low.is_finished


def test_sequence_adopting_blocks_of_a_sequence_preempted_in_the_same_step():
    # "w" adopts low's block 2 (being written this very step), then "high" preempts low: w must
    # not be left attending to a block nobody writes (Sim.check_kv asserts it).
    sim = make(max_num_seqs=2, budget=8)
    low = mkseq("low", 12, priority=5, arrival=0, max_tokens=2)
    sim.add(low)
    sim.step()
    w = mkseq("w", low.prompt_token_ids + [50], priority=0, arrival=1, max_tokens=2)
    high = mkseq("high", 4, priority=0, arrival=2, max_tokens=2)
    sim.add(w, high)
    out = sim.step()
    # w had been admitted with a 12-token hit (reading low's block 2); with low preempted it is
    # preempted too and re-admitted in the same step with the 8 tokens really in the cache.
    assert out.preempted == [low, w]
    assert ids(out) == [("high", 4), ("w", 4)]
    assert w.block_table == [0, 1, 5]  # block 2 lost its hash; high took block 4
    assert w.num_computed_tokens == 12  # 8 from the cache + 4 computed in this step
    sim.run()
    assert all(s.is_finished for s in (low, w, high))
    assert sim.bm.num_free_blocks == sim.bm.num_blocks


def test_preemptor_does_not_adopt_blocks_of_the_sequence_it_preempts():
    # w's prefix hit includes low's block 2, being written by low this step; w then needs more
    # blocks and preempts low, so block 2 will never be written: w must look up again (8 tokens).
    sim = make(num_blocks=5, budget=10)
    low = mkseq("low", 14, priority=5, arrival=0, max_tokens=2)
    sim.add(low)
    sim.step()
    assert low.block_table == [0, 1, 2]
    w = mkseq("w", low.prompt_token_ids[:12] + list(range(900, 906)), priority=0, arrival=1,
              max_tokens=2)
    sim.add(w)
    out = sim.step()
    assert out.preempted == [low] and ids(out) == [("w", 10)]
    assert w.num_cached_tokens == 8 and w.block_table == [0, 1, 4, 3, 2]
    sim.run()
    assert low.is_finished and w.is_finished


def test_tight_memory_mixed_priorities_always_drains():
    sim = make(num_blocks=10, max_num_seqs=4, budget=16)
    shared = list(range(500, 508))
    specs = [  # (rid, prompt, priority, max_tokens)
        ("p0", 20, 0, 12), ("p1", shared + [1, 2, 3], 1, 9), ("p2", 3, 2, 12),
        ("p3", shared + [4, 5], 0, 10), ("p4", 15, -1, 6), ("p5", 7, 1, 1),
        ("p6", shared + [1, 2, 3], 2, 8), ("p7", 18, 0, 14),
    ]
    seqs = [mkseq(r, p, prio, arrival=i, max_tokens=m) for i, (r, p, prio, m) in enumerate(specs)]
    sim.add(*seqs[:5])
    for s in seqs[5:]:  # later arrivals while the first ones run
        sim.step()
        sim.add(s)
    sim.run()
    for s in seqs:
        assert s.is_finished
        assert s.output_token_ids == list(range(1000, 1000 + s.params.max_tokens))
    assert sim.sched.num_preemptions > 0
    assert sim.bm.num_free_blocks == sim.bm.num_blocks


# -- finish / prefix cache / fork --------------------------------------------------------------
def test_finish_frees_blocks_running_and_waiting():
    sim = make(num_blocks=8, max_num_seqs=1)
    a, b = mkseq("a", 10, arrival=0), mkseq("b", 4, arrival=1)
    sim.add(a, b)
    sim.step()
    assert sim.bm.num_used_blocks == 3
    sim.sched.finish(a, "abort")
    assert a.status == SequenceStatus.FINISHED and a.finish_reason == "abort"
    assert a.block_table == [] and sim.bm.num_used_blocks == 0
    assert sim.sched.running == []
    sim.sched.finish(b, "abort")
    assert sim.sched.waiting == [] and not sim.sched.has_unfinished()
    assert sim.sched.schedule().is_empty


def test_identical_prompt_starts_from_the_prefix_cache():
    sim = make()
    prompt = list(range(10))
    a = mkseq("a", prompt, arrival=0)
    sim.add(a)
    sim.step()
    b = mkseq("b", prompt, arrival=1)
    sim.add(b)
    out = sim.step()
    assert ids(out) == [("a", 1), ("b", 2)]
    assert b.num_cached_tokens == 8
    assert b.block_table[:2] == a.block_table[:2] == [0, 1]
    assert (sim.bm.prefix_cache_queries, sim.bm.prefix_cache_hits) == (20, 8)
    sim.sched.finish(a, "length")
    sim.sched.finish(b, "length")
    c = mkseq("c", prompt, arrival=2)  # freed blocks stay cached
    sim.add(c)
    out = sim.step()
    assert ids(out) == [("c", 2)] and c.num_cached_tokens == 8 and c.block_table[:2] == [0, 1]


def test_identical_prompts_in_one_step_share_the_blocks_being_written():
    # The runner writes every row's K/V before attention in each layer, so b may read what a
    # writes in the same forward pass.
    sim = make()
    a, b = mkseq("a", list(range(10)), arrival=0), mkseq("b", list(range(10)), arrival=1)
    sim.add(a, b)
    out = sim.step()
    assert ids(out) == [("a", 10), ("b", 2)]
    assert b.num_cached_tokens == 8


def test_prefix_caching_disabled_computes_everything():
    sim = make(caching=False)
    a, b = mkseq("a", list(range(10)), arrival=0), mkseq("b", list(range(10)), arrival=1)
    sim.add(a)
    sim.step()
    sim.add(b)
    out = sim.step()
    assert ids(out) == [("a", 1), ("b", 10)]
    assert (sim.bm.prefix_cache_queries, sim.bm.prefix_cache_hits) == (0, 0)


def test_forked_children_copy_the_shared_partial_block():
    sim = make()
    p = mkseq("p", 6, max_tokens=3)
    sim.forks[p.seq_id] = 2
    sim.add(p)
    sim.step()
    kids = [s for s in sim.sched.running if s is not p]
    assert [k.index for k in kids] == [1, 2]
    assert p.block_table == kids[0].block_table == kids[1].block_table == [0, 1]
    out = sim.step()
    assert ids(out) == [("p", 1)] * 3
    assert out.block_copies == [(1, 2), (1, 3)]
    assert [s.block_table for s in (p, *kids)] == [[0, 2], [0, 3], [0, 1]]
    sim.run()
    assert [s.output_token_ids for s in (p, *kids)] == \
        [[1000, 1001, 1002], [1100, 1101, 1102], [1200, 1201, 1202]]
    assert sim.bm.num_free_blocks == sim.bm.num_blocks


@pytest.mark.parametrize("seed", range(40))
def test_random_workloads_drain_with_correct_kv(seed):
    """Shared prefixes, priorities, late arrivals, forks and tight memory; Sim checks every step."""
    rng = random.Random(seed)
    sim = make(num_blocks=rng.randint(9, 14), max_num_seqs=rng.randint(1, 4),
               budget=rng.choice([4, 7, 16]), caching=rng.random() < 0.8)
    stems = [[rng.randrange(50) for _ in range(rng.randint(0, 12))] for _ in range(3)]
    seqs = []
    for i in range(rng.randint(3, 9)):
        prompt = rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randint(1, 8))]
        s = mkseq(f"s{i}", prompt, priority=rng.randint(-1, 2), arrival=i,
                  max_tokens=rng.randint(1, 12))
        if rng.random() < 0.15:
            sim.forks[s.seq_id] = 1
        seqs.append(s)
    pending = list(seqs)
    for _ in range(500):
        while pending and rng.random() < 0.5:
            sim.add(pending.pop(0))
        if not pending and not sim.sched.has_unfinished():
            break
        sim.step()
    else:
        raise AssertionError("did not drain")
    for s in seqs:
        assert s.is_finished and s.num_output_tokens == s.params.max_tokens
    assert sim.bm.num_free_blocks == sim.bm.num_blocks


def test_update_finishes_on_eos_stop_token_and_length_after_min_tokens():
    bm = BlockManager(16, BS)
    sched = Scheduler(bm, 4, 64, eos_token_ids=[2], max_model_len=9)
    eos = mkseq("eos", 4)
    eos.params = SamplingParams(max_tokens=10, min_tokens=2)
    tok = mkseq("tok", 4)
    tok.params = SamplingParams(max_tokens=10, stop_token_ids=[7])
    ign = mkseq("ign", 4)
    ign.params = SamplingParams(max_tokens=10, ignore_eos=True)
    for s in (eos, tok, ign):
        sched.add(s)
    out = sched.schedule()
    assert out.sampling == [eos, tok, ign]
    applied = sched.update(out, [SampledToken(eos, 2), SampledToken(tok, 7), SampledToken(ign, 2)])
    # eos before min_tokens is a plain token; the stop token id ends "tok"; ignore_eos goes on
    assert [a.finish_reason for a in applied] == [None, "stop", None] and tok.stop_reason == 7
    assert [s.num_computed_tokens for s in (eos, ign)] == [4, 4] and tok.block_table == []
    out = sched.schedule()
    applied = sched.update(out, [SampledToken(eos, 2), SampledToken(ign, 2)])
    assert [a.finish_reason for a in applied] == ["stop", None]
    for _ in range(3):  # 4 prompt + 5 output tokens = max_model_len 9
        out = sched.schedule()
        (a,) = sched.update(out, [SampledToken(ign, 5)])
    assert a.finish_reason == "length" and ign.num_tokens == 9 and bm.num_free_blocks == 16


def test_update_skips_a_sequence_finished_since_it_was_scheduled():
    sim = make()
    a = mkseq("a", 3)
    sim.add(a)
    out = sim.sched.schedule()
    sim.sched.finish(a, "abort")
    assert sim.sched.update(out, [SampledToken(a, 5)]) == [] and a.output_token_ids == []
