"""Phase-free continuous-batching scheduler (the vLLM V1 rule).

Every step each scheduled sequence gets `num_new_tokens = num_tokens - num_computed_tokens`,
capped by one shared token budget, so a long prompt is prefilled in chunks alongside decodes
and a preempted sequence simply recomputes. Order: lower priority value first, FIFO within one.
When blocks run out the lowest-priority running sequence is preempted (its blocks freed, its
tokens recomputed later), so the engine never runs out of memory. No sequence grows past what the
cache holds (max_model_len is capped to it), so a preempted one can always be placed again.

After the model ran and the sampler chose tokens, `update(output, sampled)` does the step's
bookkeeping: computed tokens advance, n > 1 children join, tokens are appended and eos / stop token /
length checks finish sequences (stop strings need text: the engine's detokenizer decides those).
Prefix-cache hashes are registered earlier, when blocks are allocated (see block_manager.py's
invariant), so that identical prompts admitted in one step share the blocks being written.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Callable

from genpool.engine.block_manager import BlockManager
from genpool.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, num_new_tokens)
    preempted: list[Sequence] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # sequences whose step ends their known tokens: their last row's logits are sampled (in order)
    sampling: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SampledToken:
    """The token sampled for `seq` this step. `fork_of`: seq is an n > 1 child split off its parent
    (Sequence.fork) from the parent's logits row this step; update() gives it the parent's blocks."""
    seq: Sequence
    token: int
    logprob: Any = None  # carried for the engine's outputs; the scheduler does not read it
    fork_of: Sequence | None = None
    finish_reason: str | None = None  # set by update(): "stop" (eos, stop token id) or "length"
    computed: bool = False  # an accepted draft token: its K/V were written this step


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 eos_token_ids: tuple[int, ...] | list[int] = (), max_model_len: int | None = None):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.bm = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        # No sequence grows past what the cache holds, so a preempted one always fits again (see
        # _schedule_waiting); the engine caps its own max_model_len the same way (engine/limits.py)
        capacity = block_manager.num_blocks * block_manager.block_size
        self.max_model_len = min(max_model_len or capacity, capacity)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []  # kept sorted by sort_key
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # False while a sequence may not start yet (its grammar still compiling): it waits
        self.is_ready: Callable[[Sequence], bool] = lambda seq: True

    # -- queue management ------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.num_tokens >= self.max_model_len:  # could never be placed (the engine checks first)
            raise ValueError(f"a sequence of {seq.num_tokens} tokens could never be placed: the "
                             f"limit is {self.max_model_len}, including one generated token")
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def add_running(self, seq: Sequence) -> None:
        """A forked child joins the running set directly (its blocks are already shared)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self.running.sort(key=lambda s: s.sort_key)
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        out.block_copies = self.bm.take_pending_copies()
        out.sampling = [seq for seq, n in out.scheduled if seq.num_computed_tokens + n >= seq.num_tokens]
        return out

    # -- after the step --------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: list[SampledToken]) -> list[SampledToken]:
        """The step ran `out` and sampled `sampled` (out.sampling plus any forked children, in
        order): advance computed tokens, join the children, append the tokens, finish what stops.
        Returns the entries applied (a sequence finished in the meantime, by abort, is skipped)."""
        for seq, n in out.scheduled:  # a draft's tokens count once accepted (s.computed)
            seq.num_computed_tokens += min(n, seq.num_tokens - seq.num_computed_tokens)
            seq.draft = []
        for s in sampled:  # every child joins before any parent can finish (and free its blocks)
            if s.fork_of is not None:
                self._join_fork(s.fork_of, s.seq)
        applied = []
        for s in sampled:
            if s.seq.is_finished:
                continue
            s.seq.append_token(s.token)
            if s.computed:
                s.seq.num_computed_tokens += 1
            s.finish_reason = self.check_stop(s.seq, s.token)
            if s.finish_reason is not None:
                self.finish(s.seq, s.finish_reason)
            applied.append(s)
        return applied

    def _join_fork(self, parent: Sequence, child: Sequence) -> None:
        """The child was split off before this step's tokens were counted: it shares the parent's
        blocks (copy-on-write later) and joins the running set directly."""
        child.num_computed_tokens = parent.num_computed_tokens
        self.bm.fork(parent, child)
        self.add_running(child)

    def check_stop(self, seq: Sequence, token: int) -> str | None:
        """eos (unless ignore_eos) or a stop token id after min_tokens -> "stop"; max_tokens or the
        model's length -> "length"; else None. Stop strings are the detokenizer's to find."""
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop"
            if token in p.stop_token_ids:
                seq.stop_reason = token
                return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = self._num_new(seq, budget)
            if seq.draft and not self.bm.allocate_slots(seq, num_new):
                seq.draft = []  # no room for the draft: decode as usual rather than preempt
                num_new = self._num_new(seq, budget)
            while not self.bm.allocate_slots(seq, num_new):
                victim = self.running[-1]  # lowest priority, latest arrival
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled.append((seq, num_new))
                budget -= num_new
                i += 1
        return budget

    @staticmethod
    def _num_new(seq: Sequence, budget: int) -> int:
        """The tokens seq computes this step: what it has not computed, then its draft (cut to
        what the budget leaves)."""
        known = seq.num_tokens - seq.num_computed_tokens
        num_new = min(known + len(seq.draft), budget)
        del seq.draft[max(0, num_new - known):]
        return num_new

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit in queue order (passing over sequences whose grammar is still compiling); stop at
        the first sequence that cannot be placed. Skipping it would let later (smaller, or
        lower-priority) sequences take the blocks it waits for, for ever. The wait always ends: no
        sequence needs more than the whole cache (add, check_stop), so it fits once the running
        ones ahead of it finish or are preempted for it."""
        while self.waiting and budget > 0:
            seq = next((s for s in self.waiting if self.is_ready(s)), None)
            if seq is None:
                return
            while len(self.running) >= self.max_num_seqs:
                refund = self._preempt_lower(seq, out)
                if refund is None:
                    return
                budget += refund
            while True:
                # Invariant (2), block_manager.py: look up again after each preemption; a victim
                # preempted in the step it was scheduled drops its never-computed blocks from the
                # cache (and the budget grew by the refund), so an earlier lookup may be stale.
                # a sequence scoring its prompt computes every row (a cached block's never ran)
                cached = ([] if seq.prompt_score_rows(seq.num_tokens)
                          else self.bm.find_cached_blocks(seq.token_ids))
                num_new = min(seq.num_tokens - len(cached) * self.bm.block_size, budget)
                if self.bm.allocate_slots(seq, num_new, cached, self._admission_reserve()):
                    break
                refund = self._preempt_lower(seq, out)
                if refund is None:
                    return
                budget += refund
            self.bm.record_prefix_query(seq.num_tokens, len(cached))
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = len(cached) * self.bm.block_size
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, num_new))
            budget -= num_new

    def _admission_reserve(self) -> int:
        """Blocks kept free when admitting a new sequence, so running ones can still grow: without
        it a tight cache admits a prompt only to preempt it again at the next block boundary."""
        return min(len(self.running), self.bm.num_blocks // 8)

    def _preempt_lower(self, seq: Sequence, out: SchedulerOutput) -> int | None:
        """Preempt the lowest-priority running sequence when its priority value is worse than
        seq's. Returns the tokens it had been given this step (refunded), or None if none."""
        if not self.running:
            return None
        victim = max(self.running, key=lambda s: s.sort_key)
        if victim.priority <= seq.priority:
            return None
        # Invariant (3), block_manager.py: the victim may already be scheduled this step, and a
        # sequence admitted after it may have adopted (prefix hit) a block the victim was going to
        # write this step. With the victim gone nobody writes that block: adopters go too.
        refund = 0
        victims = [victim]
        while victims:
            v = victims.pop()
            if v not in self.running:
                continue
            n = next((n for s, n in out.scheduled if s is v), None)
            if n is not None:
                out.scheduled = [(s, k) for s, k in out.scheduled if s is not v]
                refund += n
                unwritten = set(v.block_table[v.num_computed_tokens // self.bm.block_size:])
                victims += [s for s, _ in out.scheduled if unwritten & set(s.block_table)]
            self._preempt(v, out)
        return refund

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Preemption by recompute: free the blocks, requeue; the prefix cache may bring them back."""
        self.running.remove(seq)
        self.bm.free(seq)
        seq.draft = []
        seq.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)
        self.add(seq)
