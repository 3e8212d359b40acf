"""GrammarCache: each distinct constraint compiled once, in two lanes by size, within a byte budget.

Why lanes: llguidance compiles a 90-character schema in about a millisecond and a ~1 MB one in
seconds. On one shared FIFO pool, 30 big schemas from one caller made a later small one from
another caller wait behind all of them. Specs of at most SMALL_SPEC_CHARS compile on their own
thread, so they never queue behind a big one. Big specs share `threads` threads and a bounded
backlog (MAX_QUEUED_CHARS of spec text waiting to start); past it a new big compile is refused at
once with a retryable error instead of waiting minutes (the bound on compile work one flood can
queue). A compile nobody waits for any more is cancelled before it starts (`release`). A
compile's time limit counts from `Compile.started` (engine/structured.py), never from submission.

Why bytes: a compiled grammar holds ~80 bytes per character of its spec (measured with llguidance
1.9: 15-16 MB for a 195 KB schema; the report saw 20-50 MB for 970 KB ones), so a cache of 256
entries could hold gigabytes. Each lane keeps an LRU within its own share of `max_bytes`
(estimated by `estimate_bytes`), so a flood of big grammars never evicts the small hot ones.
There is no caller identity in the engine (requests carry none the caller cannot forge), so
fairness is by size.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from genpool.engine.structured_params import StructuredOutputsParams
from genpool.schemas.structured import describe_error, llguidance_grammar

log = logging.getLogger("genpool.engine.structured")

SMALL_SPEC_CHARS = 16_384  # compiles in < ~20 ms: the small lane
MAX_QUEUED_CHARS = {"small": 1_000_000, "big": 4_000_000}  # spec text waiting to start, per lane
SMALL_SHARE = 4  # the small lane gets 1/SMALL_SHARE of the byte budget
BYTES_PER_CHAR, BASE_BYTES = 80, 64 << 10


def estimate_bytes(spec_chars: int) -> int:
    """What a compiled grammar of this spec size is taken to hold (see the module docstring)."""
    return BASE_BYTES + BYTES_PER_CHAR * spec_chars


@dataclass
class CompiledGrammar:
    key: tuple[str, str]
    matcher: object | None  # llguidance.LLMatcher in its start state; copied per sample
    error: str | None
    compile_s: float


class Compile:
    """One cache entry: the compile's future, when it started (monotonic; None while queued),
    its estimated bytes, and how many callers of `get` have not `release`d it."""
    __slots__ = ("key", "lane", "future", "started", "cost", "waiters")

    def __init__(self, key: tuple[str, str], lane: "_Lane | None"):
        self.key, self.lane, self.future = key, lane, Future()
        self.started: float | None = None
        self.cost, self.waiters = estimate_bytes(len(key[1])), 0

    def result(self, timeout: float | None = None) -> CompiledGrammar:
        return self.future.result(timeout)


class _Lane:
    def __init__(self, name: str, threads: int, max_bytes: int, max_queued_chars: int):
        self.name, self.max_bytes, self.max_queued_chars = name, max_bytes, max_queued_chars
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix=f"genpool-grammar-{name}")
        self.entries: OrderedDict[tuple[str, str], Compile] = OrderedDict()
        self.bytes = self.queued_chars = 0


class GrammarCache:
    """Compile each distinct constraint once, on background threads. Failed compiles are cached
    too, so a repeated bad schema costs nothing the second time."""

    def __init__(self, tokenizer_factory, max_bytes: int = 256 << 20, threads: int = 2,
                 limits=None):
        self._tokenizer_factory, self._limits = tokenizer_factory, limits
        self.max_bytes = max_bytes
        small = max_bytes // SMALL_SHARE
        self.lanes = {"small": _Lane("small", 1, small, MAX_QUEUED_CHARS["small"]),
                      "big": _Lane("big", threads, max_bytes - small, MAX_QUEUED_CHARS["big"])}
        self._lock = threading.RLock()  # future.cancel() runs done callbacks (_settled) inline
        self.hits = self.misses = self.refused = 0
        # seconds of the most recent compiles (benchmarks read them); stats() keeps running totals,
        # so a long-lived worker neither grows this nor rescans it on every engine.stats()
        self.compile_times: deque[float] = deque(maxlen=4096)
        self._compiles, self._compile_s, self._compile_max = 0, 0.0, 0.0

    def lane_of(self, key: tuple[str, str]) -> _Lane:
        return self.lanes["small" if len(key[1]) <= SMALL_SPEC_CHARS else "big"]

    def get(self, params: StructuredOutputsParams) -> Compile:
        key = params.key
        lane = self.lane_of(key)
        with self._lock:
            entry = lane.entries.get(key)
            if entry is not None:
                self.hits += 1
                entry.waiters += 1
                lane.entries.move_to_end(key)
                return entry
            self.misses += 1
            if lane.queued_chars + len(key[1]) > lane.max_queued_chars and lane.queued_chars:
                self.refused += 1
                return self._refusal(key, lane)  # not cached: the next try may find room
            entry = Compile(key, lane)
            entry.waiters = 1
            lane.entries[key] = entry
            lane.bytes += entry.cost
            lane.queued_chars += len(key[1])
            entry.future = lane.pool.submit(self._compile, entry)
            entry.future.add_done_callback(lambda _f: self._settled(lane))
            self._evict(lane)
            return entry

    @staticmethod
    def _refusal(key: tuple[str, str], lane: _Lane) -> Compile:
        entry = Compile(key, None)
        entry.started = time.monotonic()
        entry.future.set_result(CompiledGrammar(key, None, describe_error(
            key[0], f"{lane.queued_chars} characters of {lane.name} grammars already wait to "
                    f"compile on this worker (limit {lane.max_queued_chars}); retry later"), 0.0))
        return entry

    def release(self, entry: Compile) -> None:
        """A sequence stopped waiting on `entry`: the last one to leave cancels a compile that has
        not started, so work nobody wants is never done."""
        with self._lock:
            entry.waiters -= 1
            lane = entry.lane
            if entry.waiters > 0 or lane is None or not entry.future.cancel():
                return  # still wanted, a refusal, or already running / done
            lane.queued_chars -= len(entry.key[1])
            if lane.entries.get(entry.key) is entry:
                del lane.entries[entry.key]
                lane.bytes -= entry.cost

    def _settled(self, lane: _Lane) -> None:
        with self._lock:  # entries still compiling when the last get() evicted may be evicted now
            self._evict(lane)

    def _evict(self, lane: _Lane) -> None:
        """Drop finished entries, least recently used first, until the lane fits its budget
        (holders of an evicted entry keep it). Entries still compiling are never dropped."""
        for key in [k for k, e in lane.entries.items() if e.future.done()]:
            if lane.bytes <= lane.max_bytes:
                return
            lane.bytes -= lane.entries.pop(key).cost

    def _compile(self, entry: Compile) -> CompiledGrammar:
        with self._lock:
            entry.lane.queued_chars -= len(entry.key[1])
        tokenizer = self._tokenizer_factory()  # built once (on the first compile), not timed
        entry.started = time.monotonic()  # the time limit counts from here
        t0 = time.perf_counter()
        matcher, error = self._build(tokenizer, entry.key)
        dt = time.perf_counter() - t0
        with self._lock:
            self.compile_times.append(dt)
            self._compiles += 1
            self._compile_s += dt
            self._compile_max = max(self._compile_max, dt)
            if error and entry.lane.entries.get(entry.key) is entry:  # a refusal holds ~nothing
                cost = len(entry.key[1]) + len(error)
                entry.lane.bytes += cost - entry.cost
                entry.cost = cost
        if error:
            log.info("structured output %s refused (%.3f s): %s", entry.key[0], dt,
                     error.splitlines()[0])
        return CompiledGrammar(entry.key, matcher, error and describe_error(entry.key[0], error), dt)

    def _build(self, tokenizer, key: tuple[str, str]) -> tuple[object | None, str | None]:
        import llguidance

        try:
            grammar = llguidance_grammar(*key)  # one definition, shared with clients
            m = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=self._limits)
            return (None, m.get_error()) if m.is_error() else (m, None)
        except Exception as e:  # ValueError for bad JSON / GBNF; never let it reach the step loop
            return None, (str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}")

    def stats(self) -> dict:
        total, n = self.hits + self.misses, self._compiles
        return dict(grammar_cache_hits=self.hits, grammar_cache_misses=self.misses,
                    grammar_cache_hit_rate=self.hits / total if total else None,
                    grammar_compiles=n, grammar_compile_s_mean=self._compile_s / n if n else None,
                    grammar_compile_s_max=self._compile_max if n else None)

    def usage(self) -> dict:
        """Per lane: cached entries, their estimated bytes, spec characters waiting to compile."""
        with self._lock:
            return {name: dict(entries=len(ln.entries), bytes=ln.bytes, max_bytes=ln.max_bytes,
                               queued_chars=ln.queued_chars) for name, ln in self.lanes.items()}

    def close(self) -> None:
        for lane in self.lanes.values():
            lane.pool.shutdown(wait=False, cancel_futures=True)
