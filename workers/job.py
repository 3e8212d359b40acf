"""One `Job` per lane entry a worker holds, from the read to its one end (as the engine's
`Sequence` is one per request). Nothing here touches Redis or the engine.

A job moves through `JobState`: RECEIVED (read and held) -> PREPARED (parsed; its engine prompt
built, or the reason it cannot run recorded) -> CLAIMED (CLAIM_LUA answered with a `Claim`) ->
SOLO (waits to run alone) or RUNNING (in the engine) -> ENDED. It ends exactly once, through
`JobTable.finish(job, outcome)` (workers/jobs.py), with one `Outcome`.
"""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from genpool.schemas import (
    Choice,
    ErrorEvent,
    JobRequest,
    ResultEvent,
    Timings,
    TokenEvent,
    Usage,
)
from genpool.schemas.events import PromptScores

if TYPE_CHECKING:  # workers/takeover.py imports this module
    from genpool.workers.takeover import Takeover

DEAD_PAYLOAD_BYTES = 64 << 10  # how much of a junk entry is copied into the dead-letter stream
_attempts = itertools.count(1)


@dataclass
class Entry:
    """One entry of a lane stream, as read (bytes: it may hold anything a client XADDed)."""
    stream: str
    lane: str
    entry_id: str
    fields: dict
    deliveries: int = 1
    # "new": read fresh (">"), so prefix routing may hand it to a peer; "handed": a peer handed
    # it to this worker (it is never handed on again); "": reclaimed or our own pending entry
    origin: str = ""

    @property
    def enqueued_at(self) -> float:
        """The entry id's millisecond part: when Redis accepted the XADD."""
        try:
            return int(self.entry_id.split("-", 1)[0]) / 1000.0
        except ValueError:
            return 0.0

    def payload(self) -> Optional[bytes]:
        v = self.fields.get(b"job", self.fields.get("job"))
        return v.encode() if isinstance(v, str) else v

    def dead_payload(self) -> str:
        """A bounded copy of the entry for the dead-letter stream, as valid UTF-8 (invalid bytes
        become \\xNN escapes) so any client can read the dead-letter stream as text."""
        raw = self.payload()
        if raw is None:
            return repr({_b(k): _b(v)[:200] for k, v in list(self.fields.items())[:20]})
        return raw[:DEAD_PAYLOAD_BYTES].decode("utf-8", "backslashreplace")


def _b(v) -> str:  # bytes or str -> str, for messages
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


@dataclass(frozen=True)
class Fence:
    """What every write for one attempt at a job carries: its lease token (workers/lease.py),
    and its attempt number (stamped on the events, so a reader can tell attempts apart)."""
    token: str
    attempt: int


class JobState(enum.Enum):
    RECEIVED = "received"
    PREPARED = "prepared"
    CLAIMED = "claimed"
    SOLO = "solo"
    RUNNING = "running"
    ENDED = "ended"


class Claim(str, enum.Enum):
    """CLAIM_LUA's answer (schemas/scripts.py), plus REFUSED: Redis refused the script's write."""
    RUN = "run"  # ours: start it
    CHECK = "check"  # ours, but the request is invalid: answer with its error
    DUPLICATE = "duplicate"  # another entry owns this job id
    FINISHED = "finished"  # the job already ended
    CANCELLED = "cancelled"  # cancelled before it started
    DEAD = "dead"  # no job id, or charged too often
    LEASED = "leased"  # a live worker holds its lease: hand the entry back
    REFUSED = "refused"  # nothing written, no lease taken: claimed again later

    @property
    def writes(self) -> bool:
        """Whether this answer took a lease and the job's end is a fenced write."""
        return self in (Claim.RUN, Claim.CHECK, Claim.CANCELLED, Claim.DEAD)


class End(enum.Enum):
    DONE = "done"  # the result, written and acknowledged
    FAILED = "failed"  # an error event on the job's stream (the entry acknowledged)
    DEAD = "dead"  # a dead letter (and the job's error event, when it has a reader and a lease)
    ACK = "ack"  # acknowledged without a write (a duplicate, a finished job)
    HANDED_BACK = "handed_back"  # its entry given back to the live worker holding the lease
    LOST = "lost"  # another worker holds the lease now: abort, write nothing
    RELEASED = "released"  # drain timeout: handed back (fenced), rerun uncharged elsewhere
    LET_GO = "let_go"  # nothing written, nothing held: a later reclaim finds it


@dataclass(frozen=True)
class Outcome:
    end: End
    error: Optional[ErrorEvent] = None  # FAILED
    reason: str = ""  # DEAD: the dead letter's reason; HANDED_BACK: the peer's name

    @staticmethod
    def failed(code: str, message: str) -> "Outcome":
        return Outcome(End.FAILED, ErrorEvent(code=code, message=message))


DONE, ACK, LOST, RELEASED, LET_GO = (Outcome(e) for e in (End.DONE, End.ACK, End.LOST,
                                                          End.RELEASED, End.LET_GO))


def engine_request_id(job_id: str) -> str:
    """A fresh engine request id for one attempt at a job: the job id and a number unique in this
    process. The engine returns an abort's output at its next step, so an attempt aborted when its
    lease was lost can still answer after the same worker reran the job; under its own id, the
    rerun never takes that answer for its own (its own engine request would run on, orphaned)."""
    return f"{job_id}#{next(_attempts)}"


def job_id_of(engine_id: str) -> str:
    return engine_id.rpartition("#")[0]  # the number after the last '#' is ours; ids may hold '#'


@dataclass
class Job:
    entry: Entry
    state: JobState = JobState.RECEIVED
    # -- parsed (workers/intake.py) and prepared (workers/admission.py)
    req: Optional[JobRequest] = None
    job_id: Optional[str] = None  # the request's id, or one recovered from a broken request
    error: Optional[ErrorEvent] = None  # why it cannot run (job_id is set: tell its reader)
    dead_reason: Optional[str] = None  # no reader to tell: dead-letter the entry
    prompt: Optional[dict] = None  # the engine prompt: {"prompt", "prompt_token_ids"}
    # -- claimed (CLAIM_LUA)
    claim: Optional[Claim] = None
    attempt: int = 1
    detail: str = ""  # the claim's detail (a dead reason, the live lease holder's name)
    suspect: int = 0  # how often a worker was lost while it shared that worker's batch
    fence: Optional[Fence] = None  # this attempt's lease (every claim that writes has one)
    # what the job's event log says an earlier attempt left (workers/takeover.py); None: the
    # first attempt, nothing to read
    takeover: Optional["Takeover"] = None
    # -- running
    engine_id: str = ""  # this attempt's request id in the engine (engine_request_id)
    admitted_at: float = 0.0
    max_len: int = 0  # prompt + max_tokens as the engine caps them: what one sample may hold
    prompt_tokens: int = 0
    texts: dict[int, str] = field(default_factory=dict)
    ids: dict[int, list[int]] = field(default_factory=dict)
    finish: dict[int, Optional[str]] = field(default_factory=dict)
    # with logprobs: per completion one {id: logprob} map per token, and every id's text
    logprobs: dict[int, list[dict[str, float]]] = field(default_factory=dict)
    token_texts: dict[str, str] = field(default_factory=dict)
    prompt_scores: Optional[PromptScores] = None  # with prompt_logprobs, once the engine gave them
    first_token_at: Optional[float] = None
    ttft_steps: Optional[int] = None  # engine steps that ended between arrival and first token
    recorded: bool = False  # the model identity and seed went out with a first token

    @property
    def id(self) -> Optional[str]:
        return self.job_id

    @property
    def ok(self) -> bool:
        """Parsed into a valid request (it may still fail to prepare: then `error` is set)."""
        return self.req is not None and self.error is None

    @property
    def resumed(self) -> bool:
        return self.takeover is not None and self.takeover.resume is not None

    def prime(self, t: "Takeover") -> None:
        """Hold what the earlier attempt published, as if this attempt had generated it: the
        result carries the whole text, usage counts every token once, ttft is the log's."""
        self.texts = dict(t.texts)
        self.ids = {i: list(v) for i, v in t.ids.items()}
        self.logprobs = {i: list(v) for i, v in t.logprobs.items()}
        self.token_texts = dict(t.token_texts)
        self.prompt_scores = t.prompt  # a resumed prefill scores the prompt again, if asked
        self.first_token_at, self.recorded = t.first_token_at, True

    @property
    def generated(self) -> int:
        return sum(len(v) for v in self.ids.values())

    def add_delta(self, index: int, text: str, token_ids: list[int], finish: Optional[str],
                  logprobs) -> Optional[TokenEvent]:
        """Record one completion delta; the token event to publish (None when nothing new)."""
        self.texts[index] = self.texts.get(index, "") + text
        self.ids.setdefault(index, []).extend(token_ids)
        if finish is not None:
            self.finish[index] = finish
        if not text and not token_ids:
            return None
        if self.first_token_at is None:
            self.first_token_at = time.time()
        lps = None
        if logprobs:
            lps = [{str(k): float(v) for k, v in d.items()} for d in logprobs if d is not None]
            self.logprobs.setdefault(index, []).extend(lps)
        return TokenEvent(index=index, text=text, token_ids=list(token_ids), logprobs=lps)

    def _logprobs_of(self, i: int) -> dict:
        """Completion i's logprobs for its result: one map per token, with the texts of their
        ids; none when some are unknown (a resumed log that lacked them)."""
        lps = self.logprobs.get(i)
        if self.req.logprobs is None or lps is None or len(lps) != len(self.ids.get(i, [])):
            return {}
        ids = {k for d in lps for k in d}
        return {"logprobs": lps, "token_texts": {k: self.token_texts.get(k, "") for k in ids}}

    def replay_events(self) -> list[TokenEvent]:
        """Everything generated so far as one token event per completion (after a restart)."""
        return [TokenEvent(index=i, text=self.texts[i], token_ids=list(self.ids.get(i, [])))
                for i in sorted(self.texts) if self.texts[i] or self.ids.get(i)]

    def result(self, worker: str) -> ResultEvent:
        now, t0 = time.time(), self.entry.enqueued_at
        timings = Timings(queued_s=round(max(0.0, self.admitted_at - t0), 6),
                          ttft_s=round(self.first_token_at - t0, 6) if self.first_token_at else None,
                          total_s=round(now - t0, 6), ttft_steps=self.ttft_steps)
        choices = None
        if self.req.n > 1:
            choices = [Choice(index=i, text=self.texts.get(i, ""), token_ids=self.ids.get(i, []),
                              finish_reason=self.finish.get(i), **self._logprobs_of(i))
                       for i in range(self.req.n)]
        return ResultEvent(text=self.texts.get(0, ""), token_ids=list(self.ids.get(0, [])),
                           finish_reason=self.finish.get(0), worker=worker, choices=choices,
                           **self._logprobs_of(0), prompt=self.prompt_scores,
                           usage=Usage(prompt_tokens=self.prompt_tokens,
                                       completion_tokens=self.generated),
                           timings=timings)
