"""Constrained decoding with llguidance: compile off the step loop, mask only constrained rows.

Life of a constrained request:
  add_request -> `track(seq)` asks the GrammarCache (engine/grammar_cache.py) for its grammar; the
  compile runs on a background thread of its size lane (each distinct constraint once; later
  requests share the compiled matcher). The scheduler keeps the sequence waiting (`is_ready`) until
  `poll()` sees the compile done and gives the sequence its own matcher (a copy of the compiled
  one); a compile error, or a compile running past the time limit (counted from its start, never
  from a wait in the queue), fails that request alone.
  Each step -> `start_masks` fills a token bitmask for the constrained rows that sample this step
  on a helper thread while the model computes; `apply_masks` waits for it and sets the forbidden
  logits to -inf; after sampling, `accept` advances each matcher by the token it got.
Unconstrained rows never touch any of this: with no constrained row in the step, each hook is a
scan over the step's sequences for a non-None `matcher` and nothing else.

A matcher's state always equals the tokens the sequence holds: it consumes exactly the tokens
appended to it, preemption by recompute keeps those tokens, n > 1 children copy their parent's
matcher when they fork (before either consumed a generated token), and a resumed sequence's new
matcher first consumes the tokens it was resumed with (`poll`).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

import torch

from genpool.engine.grammar_cache import Compile, CompiledGrammar, GrammarCache  # noqa: F401
from genpool.engine.sequence import Sequence
from genpool.kernels.cpu.token_mask import apply_token_bitmask  # logits are on the CPU on every device
from genpool.schemas.structured import describe_error


@dataclass
class MaskJob:
    """Bitmask rows being filled for the constrained rows of one step."""
    rows: list[int]  # row of each constrained sequence among the step's sampled rows
    seqs: list[Sequence]
    bitmask: torch.Tensor  # int32 [len(rows), ceil(V / 32)]
    done: Future = field(default_factory=Future)


class StructuredOutputs:
    """Per-engine structured-output state: grammar cache, compiles waited on, mask filling."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_id: int,
                 compile_timeout_s: float = 30.0, cache_bytes: int = 256 << 20):
        self._hf_tokenizer, self.vocab_size, self.eos_token_id = hf_tokenizer, vocab_size, eos_token_id
        self.compile_timeout_s = compile_timeout_s
        self._tokenizer = None
        self._tok_lock = threading.Lock()
        self.cache = GrammarCache(self._ll_tokenizer, max_bytes=cache_bytes)
        self.pending: dict[Sequence, Compile] = {}
        self._filler = None  # (ThreadPoolExecutor, llguidance.LLExecutor), made on first use
        self._words = (vocab_size + 31) // 32

    def _ll_tokenizer(self):
        """llguidance's view of the HF tokenizer (~0.3 s to build: on a compile thread, once)."""
        with self._tok_lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_id)
            return self._tokenizer

    # -- admission -----------------------------------------------------------------------
    def track(self, seq: Sequence) -> None:
        """A constrained sequence entered the engine: start (or share) its grammar's compile."""
        self.pending[seq] = self.cache.get(seq.params.structured_outputs)

    @staticmethod
    def is_ready(seq: Sequence) -> bool:
        return seq.params.structured_outputs is None or seq.matcher is not None

    def poll(self) -> list[tuple[str, str]]:
        """Give finished compiles' sequences their matchers; (request_id, error) for failures."""
        if not self.pending:
            return []
        failed, now = [], time.monotonic()
        for seq, entry in list(self.pending.items()):
            fut, started = entry.future, entry.started
            if seq.is_finished:  # aborted while it waited
                self._forget(seq)
            elif fut.done():
                self._forget(seq)
                res: CompiledGrammar = fut.result()
                if res.error:
                    failed.append((seq.request_id, res.error))
                elif res.compile_s > self.compile_timeout_s:  # finished, but too late to count
                    failed.append((seq.request_id, self._timeout_message(seq)))
                else:
                    seq.matcher = res.matcher.deep_copy()
                    error = self._advance(seq)
                    if error is not None:
                        failed.append((seq.request_id, error))
            elif started is not None and now >= started + self.compile_timeout_s:
                self._forget(seq)  # the limit counts from the compile's start, not the queue
                failed.append((seq.request_id, self._timeout_message(seq)))
        return failed

    @staticmethod
    def _advance(seq: Sequence) -> str | None:
        """A resumed sequence already holds output tokens (engine/resume.py): the new matcher
        consumes them, so that its state equals the tokens held. The error when it rejects one."""
        for pos, tok in enumerate(seq.output_token_ids):
            if not seq.matcher.consume_token(tok):
                return describe_error(seq.params.structured_outputs.kind, (
                    f"resume refused: the constraint rejects resumed token {tok} at position "
                    f"{pos}: {seq.matcher.get_error()}"))
        return None

    def _forget(self, seq: Sequence) -> None:
        self.cache.release(self.pending.pop(seq))  # the last waiter cancels an unstarted compile

    def _timeout_message(self, seq: Sequence) -> str:
        return describe_error(seq.params.structured_outputs.kind,
                              f"grammar compile timed out (limit {self.compile_timeout_s:g} s)")

    def wait_pending(self, timeout: float) -> None:
        """Nothing else to run: sleep until a compile finishes (instead of spinning on step())."""
        if self.pending:
            wait_futures([e.future for e in self.pending.values()], timeout,
                         return_when="FIRST_COMPLETED")

    @staticmethod
    def fork(parent: Sequence, child: Sequence) -> None:
        if parent.matcher is not None:
            child.matcher = parent.matcher.deep_copy()

    # -- per step ------------------------------------------------------------------------
    def start_masks(self, sampling: list[Sequence]) -> MaskJob | None:
        """Start filling the bitmask of every constrained row that samples this step (rows
        numbered as the engine's sampled rows: the scheduler's `sampling`, in order)."""
        rows = [r for r, seq in enumerate(sampling) if seq.matcher is not None]
        seqs = [sampling[r] for r in rows]
        if not rows:
            return None
        job = MaskJob(rows, seqs, torch.empty(len(rows), self._words, dtype=torch.int32))
        pool, executor = self._mask_filler()
        job.done = pool.submit(self._fill, executor, job)
        return job

    def _mask_filler(self):
        if self._filler is None:
            import llguidance

            self._filler = (ThreadPoolExecutor(1, thread_name_prefix="genpool-mask"),
                            llguidance.LLExecutor(num_threads=1))
        return self._filler

    @staticmethod
    def _fill(executor, job: MaskJob) -> None:
        bm = job.bitmask
        executor.unsafe_compute_mask_ptr([(s.matcher, i) for i, s in enumerate(job.seqs)],
                                         bm.data_ptr(), bm.shape[1] * 4, bm.shape[0])

    def apply_masks(self, job: MaskJob | None, logits: torch.Tensor) -> list[tuple[str, str]]:
        """Forbid every token the grammar does not allow (in place). A row whose matcher is in
        error, or allows nothing at all, is left alone and reported as (request_id, error)."""
        if job is None:
            return []
        job.done.result()
        allowed = apply_token_bitmask(logits, job.rows, job.bitmask)  # C: ~30 us a row, cold logits
        failed = []
        for j, seq in enumerate(job.seqs):
            if seq.matcher.is_error() or not allowed[j]:
                failed.append((seq.request_id, self._stuck_message(seq)))
        return failed

    @staticmethod
    def _stuck_message(seq: Sequence) -> str:
        err = seq.matcher.get_error() if seq.matcher.is_error() else "no token can continue the output"
        return describe_error(seq.params.structured_outputs.kind,
                              f"the constraint cannot be satisfied after "
                              f"{seq.num_output_tokens} tokens: {err}")

    @staticmethod
    def accept(seqs: list[Sequence], tokens: list[int]) -> list[tuple[str, str]]:
        """Advance each constrained sample's matcher by the token it was given."""
        failed = []
        for seq, tok in zip(seqs, tokens):
            if seq.matcher is not None and not seq.is_finished:
                if not seq.matcher.consume_token(tok):
                    failed.append((seq.request_id, describe_error(
                        seq.params.structured_outputs.kind,
                        f"token {tok} rejected: {seq.matcher.get_error()}")))
        return failed

    def stats(self) -> dict:
        return dict(self.cache.stats(), grammar_pending=len(self.pending))

    def close(self) -> None:
        self.cache.close()
        if self._filler is not None:
            self._filler[0].shutdown(wait=False)
