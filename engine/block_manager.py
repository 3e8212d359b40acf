"""Paged KV-cache bookkeeping: ref-counted blocks, prefix caching, copy-on-write.

Pure Python (no torch) so its behaviour can be tested with exact block ids. The model runner
owns the tensors; this class only hands out block ids and tells the runner which blocks to copy.

Prefix caching: a full block is identified by a chain hash of (parent block hash, its token ids),
so a hit on block i implies the whole prefix up to block i matches. Hits are verified against the
stored parent hash and tokens, so a hash collision can never serve wrong K/V. Freed blocks that
carry a hash stay cached until a new allocation needs them (least recently freed first).

The invariant (what the three "Invariant:" notes in this file and scheduler.py keep): a block
becomes findable when allocate_slots hands it out for tokens whose K/V are written THIS step,
before they exist, so that identical prompts admitted in one step share the blocks being written.
That is sound while every hashed block either holds its K/V or is written by its owner in the
current step. Every scheduled row is written before any row attends (the runner writes each
layer's K/V first), so only one event breaks it: preempting a sequence in the step it was
scheduled. Then (1) free() forgets the hashes of its never-computed blocks, (2) the scheduler looks
prefixes up again after each preemption, and (3) sequences that adopted those blocks this step are
preempted with it. Registering hashes only after the step (vLLM V1 registers at allocation too)
would remove all three but lose same-step sharing (tests/engine/test_scheduler.py:
test_identical_prompts_in_one_step_share_the_blocks_being_written).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

NO_PARENT = -1


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = field(default_factory=tuple)


def chain_hash(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    # hash() of a tuple of ints does not depend on PYTHONHASHSEED (only str/bytes hashes are
    # salted), so every worker process of one Python version computes the same chain: the
    # prefix index (workers/prefix_index.py) compares hashes across workers.
    return hash((parent_hash, token_ids))


def prompt_block_hashes(token_ids, block_size: int) -> list[int]:
    """The chain hashes find_cached_blocks would look up for this prompt (full blocks, never
    covering the last token), in order."""
    out, parent = [], NO_PARENT
    for i in range((len(token_ids) - 1) // block_size):
        parent = chain_hash(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        out.append(parent)
    return out


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_plain: deque[int] = deque(range(num_blocks))  # never hashed: used first
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # hashed, LRU order (evict first)
        self._hash_to_block: dict[int, int] = {}
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) copy-on-write for the runner
        self.prefix_cache_queries = 0  # in tokens, as vLLM counts them
        self.prefix_cache_hits = 0

    # -- capacity ------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache lookup ---------------------------------------------------------------
    def find_cached_blocks(self, token_ids: list[int], hashes: list[int] | None = None) -> list[int]:
        """Longest chain of cached full blocks for this prefix, never covering the last token
        (its logits must be computed). Pure lookup: the scheduler records stats on success.
        `hashes`: the prompt's prompt_block_hashes when the caller has them (not hashed again)."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        usable = (len(token_ids) - 1) // bs
        hits: list[int] = []
        parent = NO_PARENT
        for i in range(usable):
            toks = tuple(token_ids[i * bs:(i + 1) * bs])
            h = hashes[i] if hashes is not None else chain_hash(parent, toks)
            bid = self._hash_to_block.get(h)
            if bid is None:
                break
            blk = self.blocks[bid]
            if blk.parent_hash != parent or blk.token_ids != toks:
                break  # a genuine collision: treat as a miss
            hits.append(bid)
            parent = h
        return hits

    def cached_hashes(self, limit: int) -> list[int]:
        """Up to `limit` hashes of cached full blocks (in use or free-but-cached), most recently
        registered last: what this worker publishes to the prefix index."""
        hashes = list(self._hash_to_block)
        return hashes[-limit:] if len(hashes) > limit else hashes

    def record_prefix_query(self, num_tokens: int, num_hit_blocks: int) -> None:
        """Prefix-cache stats in tokens, as vLLM counts them."""
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_blocks * self.block_size

    # -- allocation ------------------------------------------------------------------------
    def allocate_slots(self, seq, num_new_tokens: int, cached_blocks: list[int] | None = None,
                       reserve: int = 0) -> bool:
        """Make seq's block table cover num_computed + (cached) + num_new tokens.

        Returns False, changing nothing, when fewer than the needed blocks + `reserve` are free.
        `cached_blocks` (from find_cached_blocks) are adopted first and mark their tokens computed.
        """
        cached_blocks = cached_blocks or []
        bs = self.block_size
        computed = seq.num_computed_tokens + len(cached_blocks) * bs
        total = computed + num_new_tokens
        new_needed = self.blocks_needed(total) - len(seq.block_table) - len(cached_blocks)
        cow = self._needs_cow(seq, computed, num_new_tokens)
        revived = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        if max(new_needed, 0) + cow + reserve > self.num_free_blocks - revived:
            return False
        for bid in cached_blocks:
            self._take(bid)
            seq.block_table.append(bid)
            seq.block_hashes.append(self.blocks[bid].hash)
        seq.num_computed_tokens = computed
        if cow:
            self._copy_on_write(seq)
        for _ in range(max(new_needed, 0)):
            seq.block_table.append(self._allocate_block())
        # drafted tokens (engine/speculative.py) are not known to be right: blocks they fill are
        # hashed once verified tokens fill them, by a later allocation
        self._register_full_blocks(seq, min(total, len(seq.token_ids)))
        return True

    def _needs_cow(self, seq, computed: int, num_new: int) -> int:
        """1 when this step writes into a partially filled block someone else also holds."""
        if num_new == 0 or computed % self.block_size == 0 or not seq.block_table:
            return 0
        last = seq.block_table[computed // self.block_size]
        return int(self.blocks[last].ref_count > 1)

    def _copy_on_write(self, seq) -> None:
        idx = seq.num_computed_tokens // self.block_size
        src = seq.block_table[idx]
        dst = self._allocate_block()
        self.blocks[src].ref_count -= 1
        seq.block_table[idx] = dst
        self.pending_copies.append((src, dst))

    def _allocate_block(self) -> int:
        if self._free_plain:
            bid = self._free_plain.popleft()
        else:
            bid, _ = self._free_cached.popitem(last=False)  # evict least recently freed
            self._evict(bid)
        self.blocks[bid].ref_count = 1
        return bid

    def _evict(self, bid: int) -> None:
        blk = self.blocks[bid]
        if blk.hash is not None and self._hash_to_block.get(blk.hash) == bid:
            del self._hash_to_block[blk.hash]
        blk.hash, blk.parent_hash, blk.token_ids = None, None, ()

    def _take(self, bid: int) -> None:
        blk = self.blocks[bid]
        if blk.ref_count == 0:
            del self._free_cached[bid]
        blk.ref_count += 1

    def _register_full_blocks(self, seq, num_tokens: int) -> None:
        """Hash every block that is full once this step's tokens are written (their ids are known)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(seq.block_hashes), num_tokens // bs):
            parent = seq.block_hashes[i - 1] if i else NO_PARENT
            toks = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(parent, toks)
            seq.block_hashes.append(h)
            blk = self.blocks[seq.block_table[i]]
            if h not in self._hash_to_block and blk.hash is None:
                blk.hash, blk.parent_hash, blk.token_ids = h, parent, toks
                self._hash_to_block[h] = blk.block_id

    # -- fork / free -----------------------------------------------------------------------
    def fork(self, parent, child) -> None:
        """Child shares all of parent's blocks (child.block_table already copied)."""
        for bid in child.block_table:
            self.blocks[bid].ref_count += 1

    def free(self, seq) -> None:
        """Drop seq's references; tail blocks first so they are evicted before shared prefixes."""
        # Invariant (1), see the module docstring: a sequence preempted in the step it was
        # scheduled frees blocks hashed for tokens never computed (index >= num_computed //
        # block_size); kept cached they would serve garbage K/V. After a normal step none exist.
        for bid in seq.block_table[seq.num_computed_tokens // self.block_size:]:
            if self.blocks[bid].hash is not None:
                self._evict(bid)
        for bid in reversed(seq.block_table):
            blk = self.blocks[bid]
            blk.ref_count -= 1
            if blk.ref_count == 0:
                if blk.hash is not None:
                    self._free_cached[bid] = None
                else:
                    self._free_plain.append(bid)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies
