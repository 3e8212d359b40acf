"""Exact-behaviour tests for the pure-Python paged KV block manager (no torch).

Conventions: block_size=4 throughout; "engine step" = allocate_slots(seq, n) followed by
seq.num_computed_tokens += n (what LLMEngine does after the model runner wrote the K/V).
"""
from __future__ import annotations

import subprocess
import sys

import pytest

import genpool.engine.block_manager as bm_mod
from genpool.engine.block_manager import NO_PARENT, BlockManager, chain_hash
from genpool.engine.sequence import Sequence

BS = 4


def mkseq(tokens, rid="r") -> Sequence:
    return Sequence(rid, list(tokens), params=None)


def step(bm: BlockManager, seq: Sequence, n: int | None = None, cached=None) -> None:
    """Allocate n new tokens (default: all uncomputed ones) and mark them computed."""
    cached = cached or []
    if n is None:
        n = seq.num_tokens - seq.num_computed_tokens - len(cached) * bm.block_size
    assert bm.allocate_slots(seq, n, cached)
    seq.num_computed_tokens += n


def refs(bm: BlockManager) -> list[int]:
    return [b.ref_count for b in bm.blocks]


# -- pure Python ---------------------------------------------------------------------------
def test_engine_bookkeeping_modules_do_not_import_torch():
    # A fresh interpreter: other test modules in the same pytest session may import torch.
    code = ("import sys\n"
            "import genpool.engine.block_manager, genpool.engine.scheduler, genpool.engine.sequence\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n")
    r = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


# -- construction / capacity ----------------------------------------------------------------
def test_constructor_rejects_bad_sizes():
    with pytest.raises(ValueError):
        BlockManager(0, BS)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


def test_blocks_needed_rounds_up():
    bm = BlockManager(8, BS)
    assert [bm.blocks_needed(n) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]


def test_fresh_manager_is_all_free():
    bm = BlockManager(8, BS)
    assert (bm.num_free_blocks, bm.num_used_blocks) == (8, 0)
    assert refs(bm) == [0] * 8
    assert bm.take_pending_copies() == []


# -- allocation: exact ids --------------------------------------------------------------------
def test_allocation_hands_out_ids_in_order():
    bm = BlockManager(8, BS)
    a, b = mkseq(range(10), "a"), mkseq(range(100, 105), "b")
    assert bm.allocate_slots(a, 10)
    assert a.block_table == [0, 1, 2]
    assert bm.allocate_slots(b, 5)
    assert b.block_table == [3, 4]
    assert refs(bm) == [1, 1, 1, 1, 1, 0, 0, 0]
    assert (bm.num_free_blocks, bm.num_used_blocks) == (3, 5)


def test_allocate_slots_does_not_advance_num_computed():
    bm = BlockManager(8, BS)
    a = mkseq(range(10))
    assert bm.allocate_slots(a, 10)
    assert a.num_computed_tokens == 0  # the engine advances it after the forward pass


def test_chunked_and_decode_allocation_grows_only_at_block_boundaries():
    bm = BlockManager(8, BS)
    a = mkseq(range(10))
    step(bm, a, 3)
    assert a.block_table == [0]
    step(bm, a, 3)  # tokens 3..5
    assert a.block_table == [0, 1]
    step(bm, a, 4)  # tokens 6..9
    assert a.block_table == [0, 1, 2]
    a.append_token(50)  # token 10 goes into block 2 (offsets 8..11)
    step(bm, a, 1)
    assert a.block_table == [0, 1, 2]
    a.append_token(51)
    step(bm, a, 1)
    assert a.block_table == [0, 1, 2]
    a.append_token(52)  # position 12: a fourth block
    step(bm, a, 1)
    assert a.block_table == [0, 1, 2, 3]
    assert bm.num_used_blocks == 4


def test_allocate_zero_tokens_is_a_noop():
    bm = BlockManager(4, BS)
    a = mkseq(range(4))
    step(bm, a)
    assert bm.allocate_slots(a, 0)
    assert a.block_table == [0]
    assert bm.num_free_blocks == 3


def test_allocate_slots_out_of_blocks_returns_false_and_changes_nothing():
    bm = BlockManager(3, BS)
    a = mkseq(range(8), "a")
    step(bm, a)
    assert a.block_table == [0, 1]
    b = mkseq(range(100, 108), "b")
    hashes_before = dict(bm._hash_to_block)
    assert not bm.allocate_slots(b, 8)
    assert b.block_table == [] and b.block_hashes == [] and b.num_computed_tokens == 0
    assert refs(bm) == [1, 1, 0]
    assert bm.num_free_blocks == 1
    assert bm._hash_to_block == hashes_before
    # a decode that needs a new block fails the same way once nothing is free
    c = mkseq(range(200, 204), "c")
    step(bm, c)
    assert c.block_table == [2]
    a.append_token(9)
    assert not bm.allocate_slots(a, 1)
    assert a.block_table == [0, 1] and a.num_computed_tokens == 8
    assert refs(bm) == [1, 1, 1]


def test_allocate_with_cached_blocks_fails_atomically():
    bm = BlockManager(4, BS)
    a = mkseq(range(9), "a")
    step(bm, a)  # blocks 0,1 full+hashed, block 2 partial
    bm.free(a)
    assert bm.num_free_blocks == 4
    big = mkseq(list(range(8)) + list(range(300, 320)), "big")  # 28 tokens -> 7 blocks
    cached = bm.find_cached_blocks(big.token_ids)
    assert cached == [0, 1]
    assert not bm.allocate_slots(big, big.num_tokens - 8, cached)
    assert big.block_table == [] and big.num_computed_tokens == 0
    assert refs(bm) == [0, 0, 0, 0]
    assert bm.num_free_blocks == 4
    assert bm.find_cached_blocks(big.token_ids) == [0, 1]  # still cached


def test_free_returns_blocks_and_resets_sequence():
    bm = BlockManager(8, BS)
    a = mkseq(range(10))
    step(bm, a)
    bm.free(a)
    assert a.block_table == [] and a.block_hashes == [] and a.num_computed_tokens == 0
    assert refs(bm) == [0] * 8
    assert (bm.num_free_blocks, bm.num_used_blocks) == (8, 0)


def test_freed_plain_blocks_go_after_never_used_ones_tail_first():
    bm = BlockManager(4, BS, enable_prefix_caching=False)
    a = mkseq(range(8))
    step(bm, a)
    assert a.block_table == [0, 1]
    bm.free(a)
    b = mkseq(range(100, 116))
    step(bm, b)
    assert b.block_table == [2, 3, 1, 0]


# -- prefix cache: chain hashing ---------------------------------------------------------------
def test_full_blocks_are_registered_with_chain_hashes():
    bm = BlockManager(8, BS)
    a = mkseq(range(10))
    step(bm, a)
    h0 = chain_hash(NO_PARENT, (0, 1, 2, 3))
    h1 = chain_hash(h0, (4, 5, 6, 7))
    assert a.block_hashes == [h0, h1]  # block 2 (tokens 8, 9) is partial: not hashed
    assert (bm.blocks[0].hash, bm.blocks[0].parent_hash, bm.blocks[0].token_ids) == \
        (h0, NO_PARENT, (0, 1, 2, 3))
    assert (bm.blocks[1].hash, bm.blocks[1].parent_hash, bm.blocks[1].token_ids) == \
        (h1, h0, (4, 5, 6, 7))
    assert bm.blocks[2].hash is None
    assert bm._hash_to_block == {h0: 0, h1: 1}


def test_block_registered_once_full_during_chunked_prefill():
    bm = BlockManager(8, BS)
    a = mkseq(range(10))
    probe = list(range(10)) + [99]
    step(bm, a, 3)
    assert bm.find_cached_blocks(probe) == []
    step(bm, a, 3)  # total 6: block 0 is full
    assert bm.find_cached_blocks(probe) == [0]
    step(bm, a, 4)  # total 10: block 1 is full
    assert bm.find_cached_blocks(probe) == [0, 1]


def test_identical_prefix_hits_and_is_shared():
    bm = BlockManager(8, BS)
    a = mkseq(range(10), "a")
    step(bm, a)
    b = mkseq(range(10), "b")
    cached = bm.find_cached_blocks(b.token_ids)
    assert cached == [0, 1]
    assert bm.allocate_slots(b, 2, cached)
    assert b.num_computed_tokens == 8  # cached tokens count as computed
    assert b.block_table == [0, 1, 3]
    assert b.block_hashes == a.block_hashes
    assert refs(bm)[:4] == [2, 2, 1, 1]


def test_hits_need_the_whole_prefix():
    bm = BlockManager(8, BS)
    a = mkseq(range(13))
    step(bm, a)  # blocks 0,1,2 full
    base = list(range(13))
    assert bm.find_cached_blocks(base + [99]) == [0, 1, 2]
    changed0 = list(base)
    changed0[1] = 77  # token in block 0: blocks 1 and 2 no longer match either
    assert bm.find_cached_blocks(changed0 + [99]) == []
    changed1 = list(base)
    changed1[5] = 77  # token in block 1
    assert bm.find_cached_blocks(changed1 + [99]) == [0]
    changed2 = list(base)
    changed2[11] = 77
    assert bm.find_cached_blocks(changed2 + [99]) == [0, 1]
    # block 1's tokens alone (without block 0 in front) are not a hit
    assert bm.find_cached_blocks([4, 5, 6, 7, 8]) == []


def test_last_token_is_never_served_from_cache():
    bm = BlockManager(8, BS)
    a = mkseq(range(13))
    step(bm, a)
    assert bm.find_cached_blocks(list(range(12))) == [0, 1]  # 12 tokens: block 2 holds the last
    assert bm.find_cached_blocks(list(range(13))) == [0, 1, 2]
    assert bm.find_cached_blocks(list(range(8))) == [0]
    assert bm.find_cached_blocks(list(range(5))) == [0]
    assert bm.find_cached_blocks(list(range(4))) == []
    assert bm.find_cached_blocks([0]) == []
    assert bm.find_cached_blocks([]) == []


def test_find_cached_blocks_is_a_pure_lookup():
    bm = BlockManager(8, BS)
    a = mkseq(range(10))
    step(bm, a)
    before = (refs(bm), bm.num_free_blocks, bm.prefix_cache_queries, bm.prefix_cache_hits)
    assert bm.find_cached_blocks(list(range(10))) == [0, 1]
    assert (refs(bm), bm.num_free_blocks, bm.prefix_cache_queries, bm.prefix_cache_hits) == before


def test_constant_hash_collision_never_serves_wrong_block(monkeypatch):
    monkeypatch.setattr(bm_mod, "chain_hash", lambda parent, toks: 42)
    bm = BlockManager(8, BS)
    a = mkseq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    step(bm, a)
    # only the first block can own hash 42; block 1 collides and stays unregistered
    assert bm._hash_to_block == {42: 0}
    assert bm.blocks[1].hash is None
    assert bm.find_cached_blocks([9, 9, 9, 9, 9]) == []  # same hash, other tokens
    assert bm.find_cached_blocks([1, 2, 3, 4, 5]) == [0]
    # block 1 query hashes to 42 -> block 0, whose parent is NO_PARENT, not 42: a miss
    assert bm.find_cached_blocks([1, 2, 3, 4, 1, 2, 3, 4, 0]) == [0]
    assert bm.find_cached_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9]) == [0]


def test_parent_mismatch_is_a_miss_even_with_equal_tokens(monkeypatch):
    # a hash that ignores the parent: tokens alone collide across positions
    monkeypatch.setattr(bm_mod, "chain_hash", lambda parent, toks: hash(toks))
    bm = BlockManager(8, BS)
    a = mkseq([1, 2, 3, 4, 5, 6, 7, 8, 0])
    step(bm, a)
    assert bm.find_cached_blocks([1, 2, 3, 4, 5, 6, 7, 8, 0]) == [0, 1]
    # (5,6,7,8) as the FIRST block hashes like block 1 but block 1's parent is block 0
    assert bm.find_cached_blocks([5, 6, 7, 8, 0]) == []


def test_duplicate_content_registers_only_the_first_block():
    bm = BlockManager(8, BS)
    a, b = mkseq(range(5), "a"), mkseq(range(5), "b")
    step(bm, a)
    step(bm, b)  # computed without a cache lookup: same content, another block
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    assert a.block_hashes == b.block_hashes
    assert bm.blocks[2].hash is None
    assert bm.find_cached_blocks(list(range(5))) == [0]
    bm.free(b)  # b's unhashed blocks are plain again
    bm.free(a)
    c = mkseq(range(100, 104), "c")
    step(bm, c)
    assert c.block_table == [4]


# -- stats -------------------------------------------------------------------------------------
def test_record_prefix_query_counts_tokens():
    bm = BlockManager(8, BS)
    bm.record_prefix_query(10, 2)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (10, 8)
    bm.record_prefix_query(7, 0)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (17, 8)


# -- LRU eviction of cached free blocks --------------------------------------------------------
def test_never_hashed_blocks_are_used_before_cached_ones():
    bm = BlockManager(6, BS)
    a = mkseq(range(8), "a")
    step(bm, a)  # blocks 0,1 hashed
    bm.free(a)
    assert refs(bm) == [0] * 6 and bm.num_free_blocks == 6
    c = mkseq(range(100, 116), "c")
    step(bm, c)
    assert c.block_table == [2, 3, 4, 5]
    probe = list(range(8)) + [99]
    assert bm.find_cached_blocks(probe) == [0, 1]
    # a freed sequence's tail is evicted before its head
    d = mkseq(range(200, 204), "d")
    step(bm, d)
    assert d.block_table == [1]
    assert bm.find_cached_blocks(probe) == [0]
    e = mkseq(range(300, 304), "e")
    step(bm, e)
    assert e.block_table == [0]
    assert bm.find_cached_blocks(probe) == []
    assert bm.num_free_blocks == 0


def test_cached_blocks_evicted_least_recently_freed_first():
    bm = BlockManager(4, BS)
    a, b = mkseq(range(4), "a"), mkseq(range(10, 14), "b")
    step(bm, a)
    step(bm, b)
    assert (a.block_table, b.block_table) == ([0], [1])
    bm.free(b)  # freed first -> evicted first
    bm.free(a)
    c = mkseq(range(100, 108), "c")
    step(bm, c)
    assert c.block_table == [2, 3]
    d = mkseq(range(200, 204), "d")
    step(bm, d)
    assert d.block_table == [1]  # b's block
    assert bm.find_cached_blocks(list(range(10, 14)) + [0]) == []
    assert bm.find_cached_blocks(list(range(4)) + [0]) == [0]
    e = mkseq(range(300, 304), "e")
    step(bm, e)
    assert e.block_table == [0]


def test_reusing_a_cached_block_refreshes_its_lru_position():
    bm = BlockManager(3, BS)
    a, b = mkseq(range(4), "a"), mkseq(range(10, 14), "b")
    step(bm, a)
    step(bm, b)
    bm.free(a)  # cached LRU: [0]
    bm.free(b)  # cached LRU: [0, 1]
    a2 = mkseq(list(range(4)) + [5], "a2")
    cached = bm.find_cached_blocks(a2.token_ids)
    assert cached == [0]
    assert bm.allocate_slots(a2, 1, cached)
    assert a2.block_table == [0, 2]  # block 0 revived, block 2 never used
    assert bm.blocks[0].ref_count == 1
    a2.num_computed_tokens += 1
    bm.free(a2)  # block 2 unhashed -> plain; block 0 now more recent than block 1
    x = mkseq(range(100, 112), "x")
    step(bm, x)
    assert x.block_table == [2, 1, 0]


def test_evicted_block_loses_its_old_hash():
    bm = BlockManager(1, BS)
    a = mkseq(range(4), "a")
    step(bm, a)
    bm.free(a)
    b = mkseq(range(10, 13), "b")  # partial block: takes block 0 without a new hash
    step(bm, b)
    assert b.block_table == [0]
    assert bm.blocks[0].hash is None and bm._hash_to_block == {}
    assert bm.find_cached_blocks(list(range(4)) + [0]) == []


# -- fork / copy-on-write ----------------------------------------------------------------------
def test_fork_shares_blocks_and_copies_partial_block_on_write():
    bm = BlockManager(8, BS)
    p = mkseq(range(6), "p")
    step(bm, p)
    assert p.block_table == [0, 1]
    c = p.fork(1)
    bm.fork(p, c)
    assert c.block_table == [0, 1] and c.num_computed_tokens == 6
    assert refs(bm)[:3] == [2, 2, 0]
    p.append_token(50)
    c.append_token(60)
    step(bm, p, 1)  # writes position 6 into shared block 1 -> copy it first
    assert p.block_table == [0, 2]
    assert bm.take_pending_copies() == [(1, 2)]
    assert bm.take_pending_copies() == []
    assert refs(bm)[:3] == [2, 1, 1]
    step(bm, c, 1)  # block 1 is now only the child's: written in place
    assert c.block_table == [0, 1]
    assert bm.take_pending_copies() == []
    assert refs(bm)[:4] == [2, 1, 1, 0]
    bm.free(p)
    bm.free(c)
    assert refs(bm) == [0] * 8 and bm.num_free_blocks == 8


def test_fork_at_block_boundary_needs_no_copy():
    bm = BlockManager(8, BS)
    p = mkseq(range(8), "p")
    step(bm, p)
    c = p.fork(1)
    bm.fork(p, c)
    p.append_token(50)
    c.append_token(60)
    step(bm, p, 1)
    step(bm, c, 1)
    assert (p.block_table, c.block_table) == ([0, 1, 2], [0, 1, 3])
    assert bm.take_pending_copies() == []
    assert refs(bm)[:4] == [2, 2, 1, 1]


def test_fork_three_ways_copies_for_all_but_the_last_writer():
    bm = BlockManager(8, BS)
    p = mkseq(range(5), "p")
    step(bm, p)
    kids = [p.fork(i) for i in (1, 2)]
    for k in kids:
        bm.fork(p, k)
    assert refs(bm)[:2] == [3, 3]
    for i, s in enumerate([p, *kids]):
        s.append_token(50 + i)
        step(bm, s, 1)
    assert [s.block_table for s in (p, *kids)] == [[0, 2], [0, 3], [0, 1]]
    assert bm.take_pending_copies() == [(1, 2), (1, 3)]
    assert refs(bm)[:4] == [3, 1, 1, 1]


def test_copy_on_write_without_a_free_block_fails_atomically():
    bm = BlockManager(2, BS)
    p = mkseq(range(6), "p")
    step(bm, p)
    c = p.fork(1)
    bm.fork(p, c)
    p.append_token(50)
    assert not bm.allocate_slots(p, 1)
    assert p.block_table == [0, 1] and p.num_computed_tokens == 6
    assert refs(bm) == [2, 2]
    assert bm.take_pending_copies() == []


def test_copied_block_gets_registered_when_it_fills():
    bm = BlockManager(8, BS)
    p = mkseq(range(7), "p")
    step(bm, p)
    c = p.fork(1)
    bm.fork(p, c)
    p.append_token(50)  # fills block 1 at position 7
    step(bm, p, 1)
    assert bm.take_pending_copies() == [(1, 2)]
    assert bm.find_cached_blocks(list(range(7)) + [50, 0]) == [0, 2]


# -- prefix caching disabled -------------------------------------------------------------------
def test_disabled_prefix_caching():
    bm = BlockManager(4, BS, enable_prefix_caching=False)
    a = mkseq(range(10))
    step(bm, a)
    assert a.block_hashes == []
    assert all(b.hash is None for b in bm.blocks)
    assert bm.find_cached_blocks(list(range(10))) == []
    bm.record_prefix_query(10, 2)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (0, 0)
    bm.free(a)
    assert bm.num_free_blocks == 4 and not bm._free_cached
