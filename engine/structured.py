"""Constrained decoding with llguidance: compile off the step loop, mask only constrained rows.

Life of a constrained request:
  add_request -> `track(seq)` asks the GrammarCache for its grammar; the compile runs on a
  background thread (each distinct constraint once; later requests share the compiled matcher).
  The scheduler keeps the sequence waiting (`is_ready`) until `poll()` sees the compile done and
  gives the sequence its own matcher (a copy of the compiled one); a compile error or timeout
  fails that request alone.
  Each step -> `start_masks` fills a token bitmask for the constrained rows that sample this step
  on a helper thread while the model computes; `apply_masks` waits for it and sets the forbidden
  logits to -inf; after sampling, `accept` advances each matcher by the token it got.
Unconstrained rows never touch any of this: with no constrained row in the step, each hook is a
scan over the step's sequences for a non-None `matcher` and nothing else.

A matcher's state always equals the tokens the sequence holds: it consumes exactly the tokens
appended to it, preemption by recompute keeps those tokens, and n > 1 children copy their parent's
matcher when they fork (before either consumed a generated token).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

import torch

from genpool.engine.sequence import Sequence
from genpool.engine.structured_params import StructuredOutputsParams
from genpool.kernels.cpu.token_mask import apply_token_bitmask  # logits are on the CPU on every device
from genpool.schemas.structured import describe_error, llguidance_grammar

log = logging.getLogger("genpool.engine.structured")


@dataclass
class CompiledGrammar:
    key: tuple[str, str]
    matcher: object | None  # llguidance.LLMatcher in its start state; copied per sample
    error: str | None
    compile_s: float


class GrammarCache:
    """Compile each distinct constraint once, on background threads; LRU, at most max_entries.
    Failed compiles are cached too, so a repeated bad schema costs nothing the second time."""

    def __init__(self, tokenizer_factory, max_entries: int = 256, threads: int = 2,
                 limits=None):
        self._tokenizer_factory = tokenizer_factory
        self._limits = limits
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="genpool-grammar")
        self._entries: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self.max_entries = max_entries
        self.hits = self.misses = 0
        # seconds of the most recent compiles (benchmarks read them); stats() keeps running totals,
        # so a long-lived worker neither grows this nor rescans it on every engine.stats()
        self.compile_times: deque[float] = deque(maxlen=4096)
        self._compiles, self._compile_s, self._compile_max = 0, 0.0, 0.0

    def get(self, params: StructuredOutputsParams) -> Future:
        key = params.key
        with self._lock:
            fut = self._entries.get(key)
            if fut is not None:
                self.hits += 1
                self._entries.move_to_end(key)
                return fut
            self.misses += 1
            fut = self._pool.submit(self._compile, key)
            self._entries[key] = fut
            while len(self._entries) > self.max_entries:  # holders of an evicted entry keep it
                self._entries.popitem(last=False)
            return fut

    def _compile(self, key: tuple[str, str]) -> CompiledGrammar:
        import llguidance

        tokenizer = self._tokenizer_factory()  # built once, not part of any compile's time
        t0 = time.perf_counter()
        matcher, error = None, None
        try:
            grammar = llguidance_grammar(*key)  # one definition, shared with clients
            m = llguidance.LLMatcher(tokenizer, grammar, log_level=0,
                                     limits=self._limits)
            if m.is_error():
                error = m.get_error()
            else:
                matcher = m
        except Exception as e:  # ValueError for bad JSON / GBNF; never let it reach the step loop
            error = f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)
        dt = time.perf_counter() - t0
        with self._lock:
            self.compile_times.append(dt)
            self._compiles += 1
            self._compile_s += dt
            self._compile_max = max(self._compile_max, dt)
        if error:
            log.info("structured output %s refused (%.3f s): %s", key[0], dt, error.splitlines()[0])
        return CompiledGrammar(key, matcher, error and describe_error(key[0], error), dt)

    def stats(self) -> dict:
        total, n = self.hits + self.misses, self._compiles
        return dict(grammar_cache_hits=self.hits, grammar_cache_misses=self.misses,
                    grammar_cache_hit_rate=self.hits / total if total else None,
                    grammar_compiles=n, grammar_compile_s_mean=self._compile_s / n if n else None,
                    grammar_compile_s_max=self._compile_max if n else None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


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
                 compile_timeout_s: float = 30.0, cache_size: int = 256):
        self._hf_tokenizer, self.vocab_size, self.eos_token_id = hf_tokenizer, vocab_size, eos_token_id
        self.compile_timeout_s = compile_timeout_s
        self._tokenizer = None
        self._tok_lock = threading.Lock()
        self.cache = GrammarCache(self._ll_tokenizer, max_entries=cache_size)
        self.pending: dict[Sequence, tuple[Future, float]] = {}  # seq -> (compile, deadline)
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
        fut = self.cache.get(seq.params.structured_outputs)
        self.pending[seq] = (fut, time.monotonic() + self.compile_timeout_s)

    @staticmethod
    def is_ready(seq: Sequence) -> bool:
        return seq.params.structured_outputs is None or seq.matcher is not None

    def poll(self) -> list[tuple[str, str]]:
        """Give finished compiles' sequences their matchers; (request_id, error) for failures."""
        if not self.pending:
            return []
        failed, now = [], time.monotonic()
        for seq, (fut, deadline) in list(self.pending.items()):
            if seq.is_finished:  # aborted while it waited
                del self.pending[seq]
            elif fut.done():
                del self.pending[seq]
                res: CompiledGrammar = fut.result()
                if res.error:
                    failed.append((seq.request_id, res.error))
                elif res.compile_s > self.compile_timeout_s:  # finished, but too late to count
                    failed.append((seq.request_id, self._timeout_message(seq)))
                else:
                    seq.matcher = res.matcher.deep_copy()
            elif now >= deadline:
                del self.pending[seq]
                failed.append((seq.request_id, self._timeout_message(seq)))
        return failed

    def _timeout_message(self, seq: Sequence) -> str:
        return describe_error(seq.params.structured_outputs.kind,
                              f"grammar compile timed out (limit {self.compile_timeout_s:g} s)")

    def wait_pending(self, timeout: float) -> None:
        """Nothing else to run: sleep until a compile finishes (instead of spinning on step())."""
        if self.pending:
            wait_futures([f for f, _ in self.pending.values()], timeout, return_when="FIRST_COMPLETED")

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
