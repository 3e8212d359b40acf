"""What a worker remembers about each job it has put into its engine."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Optional

from genpool.schemas import Choice, JobRequest, ResultEvent, Timings, TokenEvent, Usage
from genpool.workers.intake import Entry
from genpool.workers.lease import Fence

_attempts = itertools.count(1)


def engine_request_id(job_id: str) -> str:
    """A fresh engine request id for one attempt at a job: the job id and a number unique in this
    process. The engine returns an abort's output at its next step, so an attempt aborted when its
    lease was lost can still answer after the same worker reran the job; under its own id, the
    rerun never takes that answer for its own (its own engine request would run on, orphaned)."""
    return f"{job_id}#{next(_attempts)}"


def job_id_of(engine_id: str) -> str:
    return engine_id.rpartition("#")[0]  # the number after the last '#' is ours; ids may hold '#'


@dataclass
class InFlight:
    req: JobRequest
    entry: Entry
    attempt: int
    admitted_at: float
    texts: dict[int, str] = field(default_factory=dict)
    ids: dict[int, list[int]] = field(default_factory=dict)
    finish: dict[int, Optional[str]] = field(default_factory=dict)
    prompt_tokens: int = 0
    first_token_at: Optional[float] = None
    ttft_steps: Optional[int] = None  # engine steps that ended between arrival and first token
    fence: Fence = Fence("", 0)  # this attempt's lease token (workers/lease.py)
    engine_id: str = ""  # this attempt's request id in the engine (engine_request_id)
    max_len: int = 0  # prompt + max_tokens as the engine caps them: what one sample may hold

    @property
    def id(self) -> str:
        return self.req.id

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
        return TokenEvent(index=index, text=text, token_ids=list(token_ids), logprobs=lps)

    def replay_events(self) -> list[TokenEvent]:
        """Everything generated so far as one token event per completion (after a restart)."""
        return [TokenEvent(index=i, text=self.texts[i], token_ids=list(self.ids.get(i, [])))
                for i in sorted(self.texts) if self.texts[i] or self.ids.get(i)]

    def result(self, worker: str) -> ResultEvent:
        now, t0 = time.time(), self.entry.enqueued_at
        timings = Timings(queued_s=round(max(0.0, self.admitted_at - t0), 6),
                          ttft_s=round(self.first_token_at - t0, 6) if self.first_token_at else None,
                          total_s=round(now - t0, 6), ttft_steps=self.ttft_steps)
        n_out = sum(len(v) for v in self.ids.values())
        choices = None
        if self.req.n > 1:
            choices = [Choice(index=i, text=self.texts.get(i, ""), token_ids=self.ids.get(i, []),
                              finish_reason=self.finish.get(i)) for i in range(self.req.n)]
        return ResultEvent(text=self.texts.get(0, ""), token_ids=list(self.ids.get(0, [])),
                           finish_reason=self.finish.get(0), worker=worker, choices=choices,
                           usage=Usage(prompt_tokens=self.prompt_tokens, completion_tokens=n_out),
                           timings=timings)
