"""Result objects, named and shaped as vLLM's so its users feel at home."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    logprobs: list[dict[int, float]] | None = None
    stop_reason: int | str | None = None  # the stop string / token that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0


@dataclass
class RequestError:
    """Why the engine failed one request (the rest of its batch ran on). `code` is
    "invalid_request" (its input or parameters caused it) or "internal" (the engine could not
    tell); `message` names the cause."""
    code: str
    message: str


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None
    error: RequestError | None = None  # set (with finished=True) when the engine failed it
    # the seed every sampled draw of this request is keyed by: the request's own, or the one the
    # engine drew for an unseeded sampled request (record it: a resume given it continues exactly;
    # engine/resume.py). None for greedy requests, whose output does not depend on one.
    seed: int | None = None
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing
    # precedes it), else {token id: logprob} with that token and the top alternatives. On the
    # first output after the prompt is computed (and on full outputs); None otherwise.
    prompt_logprobs: list[dict[int, float] | None] | None = None
