"""The engine as the worker sees it: the `Engine` protocol and its `EngineStats` (torch-free).

LLMEngine and tests/fake_engine.py's FakeEngine both satisfy `Engine`; the worker (workers/) is
written against this module only.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Protocol, runtime_checkable

from genpool.engine.outputs import RequestOutput
from genpool.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineStats(Mapping):
    """A snapshot of the engine's state and cumulative counters. Read it by attribute; the Mapping
    view (stats["kv_blocks_used"], dict(stats)) is kept for code written when stats() was a dict."""
    num_running: int
    num_waiting: int
    free_seq_slots: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_used: int
    block_size: int
    num_requests: int = 0
    step_count: int = 0
    decode_steps: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    requests_finished: int = 0
    prefix_cache_queries: int = 0  # in tokens, as vLLM counts them
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    spec_draft_tokens: int = 0  # speculative decoding (engine/speculative.py): tokens drafted
    spec_accepted_tokens: int = 0  # and accepted
    decode_step_time_mean: float | None = None  # seconds; None before the first pure-decode step
    # structured outputs (engine/structured.py): the grammar cache and compiles waiting
    grammar_cache_hits: int = 0
    grammar_cache_misses: int = 0
    grammar_cache_hit_rate: float | None = None
    grammar_compiles: int = 0
    grammar_compile_s_mean: float | None = None
    grammar_compile_s_max: float | None = None
    grammar_pending: int = 0

    def __getitem__(self, key: str) -> Any:
        if key not in _STAT_NAMES:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self):
        return iter(_STAT_NAMES)

    def __len__(self) -> int:
        return len(_STAT_NAMES)


_STAT_NAMES = tuple(f.name for f in fields(EngineStats))


@runtime_checkable
class Engine(Protocol):
    """What a worker needs of an engine."""
    tokenizer: Any  # called as tokenizer(text, add_special_tokens=...)["input_ids"]
    # The prefix cache prefix-aware routing reads (engine/block_manager.py's BlockManager:
    # block_size, enable_prefix_caching, cached_hashes, find_cached_blocks); None for an engine
    # without one (a fake, a remote engine): routing is then off.
    block_manager: Any
    max_model_len: int  # prompt + generated tokens of one sequence at most (max_tokens is capped)

    def apply_chat_template(self, messages: list[dict]) -> str: ...

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None,
                    resume: Any = None) -> None: ...
    # resume: an engine/resume.py ResumeState (continue after those tokens); ValueError: refused

    def model_identity(self) -> Any: ...  # an engine/identity.py ModelIdentity

    def abort_request(self, request_id: str | list[str]) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    def describe(self) -> str:
        """One line: device, dtype, kernels, KV capacity (logged once when a worker starts)."""
        ...
