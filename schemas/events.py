"""Events a worker writes to a job's stream (field `event`), and the result object readers get.

A job's stream is a log a reader replays from the start: zero or more `token` events, possibly
interrupted by `restart` (the job is being rerun from scratch: discard what you have) or by `resume`
(a worker took the job over and continues it after the tokens the log holds), and exactly one
terminal event, `result` or `error`.
"""
from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from .keys import PROTOCOL_VERSION

ErrorCode = Literal["invalid_request", "unknown_model", "expired", "cancelled", "dead_lettered",
                    "internal"]
# "cancelled" only on a JobResult the client builds for a cancelled job (the wire says `error`).
FinishReason = Literal["stop", "length", "abort", "cancelled"]


class _Wire(BaseModel):
    # Readers ignore fields they do not know, so workers can add fields within a version.
    model_config = ConfigDict(extra="ignore")
    v: int = PROTOCOL_VERSION


class TokenEvent(_Wire):
    type: Literal["token"] = "token"
    attempt: Optional[int] = None  # which attempt wrote it (see RestartEvent)
    index: int = 0  # which of the n completions
    text: str = ""  # the new piece of text (a delta)
    token_ids: list[int] = Field(default_factory=list)
    # One {token_id: logprob} map per new token, when the request asked for logprobs: the top
    # `logprobs` ids and the sampled one, from the model's raw distribution (log-softmax of the
    # logits before penalties, temperature, top-p or logit bias).
    logprobs: Optional[list[dict[str, float]]] = None
    # With logprobs: each id in them decoded alone, so readers without the tokenizer (the
    # gateway's OpenAI logprobs) can name the tokens. A token that is part of a multi-byte
    # character decodes to U+FFFD.
    token_texts: Optional[dict[str, str]] = None
    # On an attempt's first token only: what a worker that takes the job over needs to continue
    # it exactly (workers/takeover.py): the engine's model identity and the sampling seed.
    model_identity: Optional[dict] = None
    seed: Optional[int] = None
    # With prompt_logprobs, on completion 0's first token event (and on the result)
    prompt: Optional["PromptScores"] = None


class PromptScores(BaseModel):
    """The prompt's own logprobs (JobRequest.prompt_logprobs): its token ids, one entry per
    token (None for the first, which nothing precedes; else {token_id: logprob} with that token
    and the top alternatives, from the model's raw distribution), and every id's text."""
    model_config = ConfigDict(extra="ignore")
    token_ids: list[int]
    logprobs: list[Optional[dict[str, float]]]
    token_texts: dict[str, str] = Field(default_factory=dict)
    # a token-id prompt decoded whole (the gateway's echo): joining token_texts would turn a
    # character split over byte-level tokens into U+FFFDs
    text: Optional[str] = None


class RestartEvent(_Wire):
    type: Literal["restart"] = "restart"
    reason: str = ""
    attempt: int = 1
    text: str = ""  # so a reader that concatenates `.text` can treat every event alike


class ResumeEvent(_Wire):
    """A worker took the job over and continues it: completion i goes on after its first
    `tokens[i]` tokens, as the log before this event holds them. A reader that has seen exactly
    those has nothing to do (the Python client shows nothing); one that has seen more (Redis
    lost the tail of the stream: AOF everysec, a failover) must drop what is past them."""
    type: Literal["resume"] = "resume"
    attempt: int = 1
    tokens: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)  # counts: never < 0


class RewindEvent(_Wire):
    """Never on the wire: what the Python client yields when a `resume` continues completion
    `index` from token `token_index`, fewer tokens than this reader was shown (they were lost
    with the tail of the stream). Drop the last `dropped` tokens and `dropped_text` of that
    completion; the text after this event continues from there."""
    type: Literal["rewind"] = "rewind"
    index: int = 0
    token_index: int = 0
    dropped: int = 0
    dropped_text: str = ""
    text: str = ""  # so a reader that concatenates `.text` can treat every event alike


class Usage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Timings(BaseModel):
    model_config = ConfigDict(extra="ignore")
    queued_s: float = 0.0  # enqueue (stream entry time) -> added to an engine
    ttft_s: Optional[float] = None  # enqueue -> first token written
    total_s: float = 0.0  # enqueue -> result written
    # Engine steps that ended between the job's arrival (stream entry time) and its first token,
    # that one included: 1 = the first step after it arrived produced its first token.
    ttft_steps: Optional[int] = None


class ToolFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    """One tool call in OpenAI's shape. Never on the wire: the Python client parses them out of
    the answer of a job submitted with `tools` (producer/openai_tools.py)."""
    model_config = ConfigDict(extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: ToolFunction


class Choice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    index: int
    text: str
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: Optional[FinishReason] = None
    logprobs: Optional[list[dict[str, float]]] = None  # as TokenEvent's, one map per token
    token_texts: Optional[dict[str, str]] = None  # as TokenEvent's
    # Only for a job submitted with `tools` through the Python client (workers never set them):
    # the calls parsed out of `text`, and the text outside them (None when it is only calls).
    tool_calls: Optional[list[ToolCall]] = None
    content: Optional[str] = None


class ResultEvent(_Wire):
    type: Literal["result"] = "result"
    attempt: Optional[int] = None
    text: str
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: Optional[FinishReason] = None
    usage: Usage = Field(default_factory=Usage)
    timings: Timings = Field(default_factory=Timings)
    choices: Optional[list[Choice]] = None  # all n completions when n > 1
    worker: Optional[str] = None
    logprobs: Optional[list[dict[str, float]]] = None  # completion 0's, when asked (as Choice)
    token_texts: Optional[dict[str, str]] = None
    prompt: Optional[PromptScores] = None  # with prompt_logprobs


class ErrorEvent(_Wire):
    type: Literal["error"] = "error"
    attempt: Optional[int] = None
    code: ErrorCode
    message: str


class TrimmedEvent(_Wire):
    """Never on the wire: what the Python client yields where a job's event stream lost events
    to its length cap (MAXLEN, `genpool worker --events-maxlen`) before this reader read them:
    a reader that fell more than the cap behind. Their text is missing from what was streamed
    (and only there: the result event carries the whole completion). docs/protocol.md tells
    how a reader detects it."""
    type: Literal["trimmed"] = "trimmed"
    events: int  # how many events were dropped unread
    text: str = ""  # so a reader that concatenates `.text` can treat every event alike


Event = Annotated[Union[TokenEvent, RestartEvent, ResumeEvent, ResultEvent, ErrorEvent],
                  Field(discriminator="type")]
EventAdapter: TypeAdapter = TypeAdapter(Event)
TERMINAL = ("result", "error")


def parse_event(data: Union[str, bytes]
                ) -> Union[TokenEvent, RestartEvent, ResumeEvent, ResultEvent, ErrorEvent]:
    return EventAdapter.validate_json(data)


class JobResult(BaseModel):
    """What `Job.result()` returns: the completion, or `.error` when the job failed."""
    model_config = ConfigDict(extra="ignore")
    id: str
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: Optional[FinishReason] = None
    usage: Usage = Field(default_factory=Usage)
    timings: Timings = Field(default_factory=Timings)
    choices: Optional[list[Choice]] = None
    worker: Optional[str] = None
    logprobs: Optional[list[dict[str, float]]] = None
    token_texts: Optional[dict[str, str]] = None
    tool_calls: Optional[list[ToolCall]] = None  # completion 0's, as Choice's (tools only)
    content: Optional[str] = None  # as Choice's (tools only)
    prompt: Optional[PromptScores] = None  # with prompt_logprobs: the prompt's own logprobs
    error: Optional[ErrorEvent] = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @classmethod
    def from_event(cls, job_id: str, ev: Union[ResultEvent, ErrorEvent]) -> "JobResult":
        if isinstance(ev, ErrorEvent):
            return cls(id=job_id, error=ev)
        return cls(id=job_id, **ev.model_dump(exclude={"type", "v"}))


TokenEvent.model_rebuild()  # its `prompt` names PromptScores, defined after it
