"""Resume, not restart: what a worker that takes a job over reads from the job's event log.

A job whose earlier attempt was lost (its worker died, stalled past its lease, or drained and
handed it over) already has, in its event stream, every token that attempt published, fenced:
once CLAIM_LUA gave this attempt the lease, no write of the earlier one can land any more, so the
log read after the claim is final. `plan` turns it into a `Takeover`: the tokens of each
completion as an engine `ResumeState` (the engine continues after them, engine/resume.py), the
text and token ids the job already holds, and when its first token was written. Where a resume
could not continue exactly, `plan` says why and the job restarts as before (a `restart` event
with that reason): the log's start was trimmed or lost, its first token recorded no model
identity (a worker from before resume) or another one than this engine's, n differs.

The first token of every attempt records the engine's model identity and sampling seed
(TokenEvent.model_identity, .seed), so the next taker can tell.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from genpool.engine.identity import ModelIdentity
from genpool.engine.resume import ResumeState
from genpool.schemas import RestartEvent, ResumeEvent, TokenEvent
from genpool.schemas.events import PromptScores, parse_event
from genpool.schemas.keys import field_int, field_text
from genpool.schemas.scripting import pipelined
from genpool.workers.job import Job


@dataclass
class Takeover:
    resume: Optional[ResumeState] = None  # None: start from the beginning
    restart: str = ""  # why the job restarts ("" when it resumes, or nothing was published)
    texts: dict[int, str] = field(default_factory=dict)
    ids: dict[int, list[int]] = field(default_factory=dict)
    first_token_at: Optional[float] = None  # when the log's first token was written
    logprobs: dict[int, list[dict[str, float]]] = field(default_factory=dict)  # as published
    token_texts: dict[str, str] = field(default_factory=dict)
    prompt: Optional[PromptScores] = None  # the prompt's logprobs, when the log published them

    @property
    def tokens(self) -> list[int]:
        """Per completion, how many tokens the resume goes on after (the `resume` event)."""
        return [len(t) for t in self.resume.token_ids] if self.resume else []


@dataclass
class _Log:
    """The current attempt's part of a log: everything after its last `restart`."""
    texts: dict[int, str] = field(default_factory=dict)
    ids: dict[int, list[int]] = field(default_factory=dict)
    # one logprob map per token as published (None where an event carried none for its tokens)
    logprobs: dict[int, list[Optional[dict[str, float]]]] = field(default_factory=dict)
    token_texts: dict[str, str] = field(default_factory=dict)
    first: Optional[TokenEvent] = None
    first_at: Optional[float] = None

    def add(self, ev: TokenEvent, at: float) -> None:
        if self.first is None:
            self.first, self.first_at = ev, at
        i = ev.index
        self.texts[i] = self.texts.get(i, "") + ev.text
        self.ids.setdefault(i, []).extend(ev.token_ids)
        lps = ev.logprobs or []
        # a map per token, keyed by token ids, else none of them is known (int() of a key that
        # is no id would fail this worker's admission)
        if len(lps) == len(ev.token_ids) and all(
                field_int(k) is not None for d in lps if d is not None for k in d):
            self.token_texts.update(ev.token_texts or {})
        else:
            lps = [None] * len(ev.token_ids)
        self.logprobs.setdefault(i, []).extend(lps)

    def engine_logprobs(self, n: int) -> list[list[Optional[dict[int, float]]]]:
        """The maps as the engine takes them (int ids), per completion."""
        return [[{int(k): v for k, v in d.items()} if d is not None else None
                 for d in self.logprobs.get(i, [])] for i in range(n)]

    def complete_logprobs(self) -> dict[int, list[dict[str, float]]]:
        """The completions whose every token has its map (what the result can carry)."""
        return {i: list(v) for i, v in self.logprobs.items() if all(d is not None for d in v)}


def read_logs(r, keys, jobs: list[Job]) -> list[list]:
    """Each job's whole event stream (one pipelined round trip; a stream holds at most the
    events cap, ~16k entries)."""
    return pipelined(r, jobs, lambda pipe, j: pipe.xrange(keys.events(j.job_id)))


def plan(entries, n: int, identity: ModelIdentity) -> Takeover:
    """What to do with a job taken over, from its event stream's entries (XRANGE's reply)."""
    log, expected = _Log(), 1
    for entry_id, fields in entries or []:
        fields = {field_text(k): v for k, v in fields.items()}
        if _seq(fields) != expected:  # trimmed (the cap), or lost (a Redis that forgot)
            return Takeover(restart=f"its event log is incomplete (entry {expected} is "
                                    f"missing): rerun from the start")
        expected += 1
        try:
            ev = parse_event(fields["event"])
        except (KeyError, ValueError):  # pydantic's ValidationError is a ValueError
            # another writer's garbage must not fail this worker's admission: the job reruns
            return Takeover(restart=f"its event log has an unreadable entry ({expected - 1}): "
                                    f"rerun from the start")
        if isinstance(ev, RestartEvent):
            log = _Log()
        elif isinstance(ev, TokenEvent):
            log.add(ev, _entry_time(entry_id))
        elif not isinstance(ev, ResumeEvent):
            return Takeover(restart=f"its log already ends ({ev.type})")
    if log.first is None:
        return Takeover()  # nothing published: a plain start, no reader to tell
    why = _why_not(log, n, identity)
    if why:
        return Takeover(restart=f"{why}: rerun from the start")
    token_ids = [log.ids.get(i, []) for i in range(n)]
    return Takeover(
        resume=ResumeState(token_ids=token_ids, seed=log.first.seed,
                           logprobs=log.engine_logprobs(n)),
        texts=dict(log.texts), ids={i: list(v) for i, v in log.ids.items()},
        first_token_at=log.first_at, logprobs=log.complete_logprobs(),
        token_texts=log.token_texts, prompt=log.first.prompt)


def _why_not(log: _Log, n: int, identity: ModelIdentity) -> str:
    if any(i >= n or i < 0 for i in log.ids):
        return f"its log holds completions beyond n={n}"
    recorded = log.first.model_identity
    if recorded is None:
        return "its first token recorded no model identity"
    try:
        theirs = ModelIdentity.from_dict(recorded)
    except (KeyError, TypeError) as e:
        return f"its recorded model identity is unreadable ({e})"
    return theirs.mismatch(identity) or ""


def _seq(fields: dict) -> Optional[int]:
    try:
        return int(fields.get("seq"))
    except (TypeError, ValueError):
        return None


def _entry_time(entry_id) -> float:
    return int(field_text(entry_id).split("-", 1)[0]) / 1000.0
