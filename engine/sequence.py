"""One `Sequence` owns a sample's tokens, counters and block table (nano-vllm style)."""
from __future__ import annotations

import itertools
import time
from enum import Enum
from typing import Any

_seq_counter = itertools.count()


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """A prompt plus one sample of generated tokens.

    `num_computed_tokens` counts tokens whose K/V sit in the cache; the scheduler gives each
    sequence `num_tokens - num_computed_tokens` more (capped by the step's token budget), so
    prefill, chunked prefill, decode and recompute after preemption are one rule.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: Any,
                 priority: int = 0, arrival_time: float | None = None, index: int = 0):
        self.seq_id = next(_seq_counter)
        self.request_id = request_id
        self.index = index  # which of the request's n samples
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache on first schedule
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chain hashes of this sequence's full blocks, in order
        self.status = SequenceStatus.WAITING
        self.params = params
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.finish_reason: str | None = None
        self.stop_reason: Any = None
        self.pending_forks = 0  # n > 1: children still to fork off after the prompt is computed
        # the sampling seed: the request's, or one the engine drew at admission (RequestOutput.seed);
        # with the index and the output length it keys every draw (engine/randomness.py)
        self.seed: int | None = None
        self.detokenizer = None
        self.matcher = None  # llguidance matcher of a constrained sample (engine/structured.py)
        self.logprobs: list[dict[int, float]] = []
        # prompt_logprobs: positions 0..prompt_scored-1 have scored the token after them
        self.prompt_scored = 0
        self.scores_prompt = index == 0  # the sample that scores it (a resume may pick another)
        # speculative tokens this step verifies (engine/speculative.py); [] after every step
        self.draft: list[int] = []
        self.first_token_time: float | None = None
        self.num_preemptions = 0

    # -- token views -------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def sort_key(self) -> tuple:
        """Lower priority value first, then FIFO by arrival, then creation order."""
        return (self.priority, self.arrival_time, self.seq_id)

    def prompt_score_rows(self, n: int) -> range:
        """Positions of this step's chunk (n tokens from num_computed_tokens) whose rows score the
        prompt token after them (params.prompt_logprobs; engine/prompt_logprobs.py). One sample
        scores (completion 0: its siblings fork after the prompt or, resumed, compute it again;
        engine/resume.py picks another when completion 0 had ended), and what it scored before
        a preemption is not scored twice."""
        if not self.scores_prompt or self.params is None or self.params.prompt_logprobs is None:
            return range(0)
        lo = max(self.num_computed_tokens, self.prompt_scored)
        return range(lo, max(lo, min(self.num_computed_tokens + n, self.num_prompt_tokens - 1)))

    def step_token_ids(self, n: int) -> list[int]:
        """The n input tokens of this step's chunk: known tokens from num_computed_tokens on,
        then the draft's."""
        start = self.num_computed_tokens
        known = self.token_ids[start:start + n]
        return known + self.draft[:n - len(known)] if len(known) < n else known

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def fork(self, index: int) -> "Sequence":
        """A child sample sharing everything computed so far (blocks are shared by the caller)."""
        child = Sequence(self.request_id, self.prompt_token_ids, self.params, self.priority,
                         self.arrival_time, index)
        child.token_ids = list(self.token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.block_table = list(self.block_table)
        child.block_hashes = list(self.block_hashes)
        child.status = self.status
        return child

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id!r}, idx={self.index}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={self.block_table}, {self.status.value})")
