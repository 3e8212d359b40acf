"""JobRequest: what a producer XADDs (field `job`) onto a lane stream.

Sampling fields carry the engine's SamplingParams names and defaults so a request maps 1:1 onto
`engine.SamplingParams(**req.sampling_kwargs())`. Strict types: the wire is JSON from any language,
and silently turning "12" into 12 would hide producer bugs.
"""
from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .keys import JOB_ID_RE, PROTOCOL_VERSION, lane_for
from .structured import StructuredOutputs
from .tenants import DEFAULT_TENANT, TENANT_CHARS

MAX_PROMPT_CHARS = 1_000_000
MAX_PROBLEMS_SHOWN = 8  # of a request's validation problems, in its error message
MAX_ID_LEN = 128
# Job ids name Redis keys ({p}:job:{<id>}), so they may not hold ':' or braces: no id can then
# spell another job's key or move its keys out of their {<id>} hash tag (docs/protocol.md).
ID_PATTERN = JOB_ID_RE.pattern  # the one job-id rule (schemas/keys.py)
# Sampling bounds: the same numbers as genpool.engine.sampling_params (no parameter inside them can make
# a logit inf or nan); this module must not import the engine (no torch for producers).
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MAX_STOP_LEN = 1024
MAX_TOKEN_ID = 2**31  # exclusive; the engine checks stop_token_ids against its vocabulary
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LEN)]
TokenId = Annotated[int, Field(ge=0, lt=MAX_TOKEN_ID)]
MAX_LOGPROBS = 20  # alternatives per token a job may ask log-probabilities for (the engine's bound)
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]  # a token id as a JSON object key

# The most urgent priority a caller of a front door may ask for (lower runs sooner: keys.lane_for):
# the gateway's default ceiling (its --priority) and the Celery task's. Only producers that hold
# the Redis URL itself choose any value; without a ceiling, any caller could jump every queue.
CALLER_PRIORITY_CEILING = -1

SAMPLING_FIELDS = (
    "n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens",
    "logprobs", "prompt_logprobs", "logit_bias", "speculative",
)


def check_priority(priority: Any, ceiling: int = CALLER_PRIORITY_CEILING,
                   who: str = "this front door") -> None:
    """ValueError when `priority` asks to run sooner than `ceiling` allows (asking to run
    later is always fine; a value that is no integer is left to JobRequest to refuse)."""
    if isinstance(priority, int) and not isinstance(priority, bool) and priority < ceiling:
        raise ValueError(f"priority {priority} is above what {who} allows (lowest value "
                         f"{ceiling})")


def new_job_id() -> str:
    return uuid.uuid4().hex


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    role: Literal["system", "user", "assistant", "tool"]
    content: str = Field(max_length=MAX_PROMPT_CHARS)


class JobRequest(BaseModel):
    # allow_inf_nan: Python's json accepts NaN / Infinity literals, which no field may carry
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    v: Literal[1] = PROTOCOL_VERSION
    id: str = Field(default_factory=new_job_id, min_length=1, max_length=MAX_ID_LEN,
                    pattern=ID_PATTERN)
    model: Optional[str] = Field(default=None, min_length=1, max_length=256)
    prompt: Optional[str] = Field(default=None, min_length=1, max_length=MAX_PROMPT_CHARS)
    # fail_fast on lists: a hostile list of a million bad items is one error, not a million
    messages: Optional[list[ChatMessage]] = Field(default=None, min_length=1, max_length=1000,
                                                  fail_fast=True)
    # a prompt already tokenized with the model's tokenizer (OpenAI's token-id prompts;
    # lm-eval-harness sends them): used as given, no special tokens added
    prompt_token_ids: Optional[list[TokenId]] = Field(default=None, min_length=1,
                                                      max_length=MAX_PROMPT_CHARS, fail_fast=True)

    n: int = Field(default=1, ge=1, le=16)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1, lt=2**31)  # -1 or 0: disabled, as in the engine
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, ge=MIN_REPETITION_PENALTY,
                                      le=MAX_REPETITION_PENALTY)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: Optional[int] = Field(default=None, ge=-(2**63), lt=2**63)  # int64, as OpenAI's
    stop: list[StopString] = Field(default_factory=list, max_length=16, fail_fast=True)
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=64, fail_fast=True)
    ignore_eos: bool = False
    max_tokens: int = Field(default=16, ge=0, le=1_000_000)  # 0: only with prompt_logprobs
    min_tokens: int = Field(default=0, ge=0, le=1_000_000)
    logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # the prompt's own logprobs (JobResult.prompt_logprobs; the gateway's echo), 0-20 alternatives
    prompt_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # {token id (a JSON object's keys are strings): bias in [-100, 100]}, at most 1024 ids
    logit_bias: Optional[dict[TokenIdKey, Annotated[float, Field(ge=-100.0, le=100.0)]]] = Field(
        default=None, max_length=1024)
    structured_outputs: Optional[StructuredOutputs] = None  # schemas/structured.py
    # speculative (n-gram) decoding: null as the worker is configured, false off, true on
    speculative: Optional[bool] = None

    priority: int = Field(default=0, ge=-(2**31), lt=2**31)
    # who the job is for (schemas/tenants.py): fair share, quotas, usage and isolation key on it
    tenant: str = Field(default=DEFAULT_TENANT, pattern=f"^{TENANT_CHARS}$")
    deadline: Optional[float] = Field(default=None, gt=0)
    metadata: Optional[dict[str, Any]] = None

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_keys(cls, v: Any) -> Any:
        # JSON object keys are strings; a Python caller writes {token_id: bias}
        if isinstance(v, dict):
            return {str(k) if isinstance(k, int) and not isinstance(k, bool) else k: val
                    for k, val in v.items()}
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_str(cls, v: Any) -> Any:
        # A bare string is the common single-stop form in OpenAI-style APIs.
        return [v] if isinstance(v, str) else v

    @field_validator("stop")
    @classmethod
    def _stop_nonempty(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        return v

    @model_validator(mode="after")
    def _cross_fields(self) -> "JobRequest":
        given = [f for f in ("prompt", "messages", "prompt_token_ids") if getattr(self, f) is not None]
        if len(given) != 1:
            got = " and ".join(given) or "none"
            raise ValueError(f"exactly one of 'prompt', 'messages' or 'prompt_token_ids' is "
                             f"required (got {got})")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise ValueError("max_tokens 0 needs prompt_logprobs (score the prompt, generate "
                             "nothing)")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens "
                             f"({self.max_tokens})")
        return self

    @property
    def lane(self) -> str:
        return lane_for(self.priority)

    def sampling_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for engine.SamplingParams."""
        out = {f: getattr(self, f) for f in SAMPLING_FIELDS}
        if self.structured_outputs is not None:
            out["structured_outputs"] = self.structured_outputs.engine_dict()
        return out

    def to_wire(self) -> str:
        # the default tenant stays off the wire: a worker from before tenants reads the job too
        drop = {"tenant"} if self.tenant == DEFAULT_TENANT else None
        return self.model_dump_json(exclude_none=True, by_alias=True, exclude=drop)


def describe_validation_error(exc: ValidationError) -> str:
    """One part per problem, naming the field and what was sent; unknown fields listed clearly.
    The first MAX_PROBLEMS_SHOWN, then a count of the rest: the message goes to the job's stream
    and hash, and a hostile request can hold thousands of problems."""
    parts, errors = [], exc.errors(include_url=False)
    for err in errors[:MAX_PROBLEMS_SHOWN]:
        loc = _cut(".".join(str(p) for p in err["loc"]) or "request", 200)
        if err["type"] == "extra_forbidden":
            parts.append(f"unknown field {loc!r}")
            continue
        msg = err["msg"].removeprefix("Value error, ")
        if err["loc"] and err["type"] not in ("missing",):
            parts.append(f"{loc}: {msg} (got {_short(err.get('input'))})")
        else:
            parts.append(f"{loc}: {msg}")
    more = len(errors) - MAX_PROBLEMS_SHOWN
    return "; ".join(parts) + (f"; and {more} more problems" if more > 0 else "")


def _short(value: Any, limit: int = 60) -> str:
    return _cut(repr(value), limit)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_request(data: Union[str, bytes, dict]) -> JobRequest:
    """Parse a wire job (JSON text or dict); raises ValidationError."""
    if isinstance(data, dict):
        return JobRequest.model_validate(data)
    return JobRequest.model_validate_json(data)
