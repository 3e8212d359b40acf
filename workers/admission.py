"""From parsed jobs to startable ones: the engine prompt, then the ownership check (CLAIM_LUA).

`Admitter.settle` turns each claim into the job's end (an `Outcome` for JobTable.finish) or None:
start it. Every entry ends in exactly one of: running in the engine, an error on its job's stream
(acked), a dead letter (acked), a silent ack (a duplicate of a job id another entry owns, or a job
that already finished), or handed back to the live worker that holds its lease. A job whose claim
Redis refused (a write refused: OOM, NOREPLICAS) is none of these yet: it is held and claimed
again (workers/admit.py), never dead-lettered for it.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

from genpool.schemas import ErrorEvent, JobRequest
from genpool.schemas.keys import field_text
from genpool.schemas.scripting import Script, pipelined
from genpool.schemas.scripts import CLAIM_LUA
from genpool.workers.job import ACK, Claim, End, Fence, Job, JobState, Outcome
from genpool.workers.lease import new_token
from genpool.workers.streams import refused
from genpool.workers.takeover import Takeover, plan, read_logs

SOLO_AFTER = 2  # lost-worker batches a job may share before it runs alone (see CLAIM_LUA)
CLAIM = Script(CLAIM_LUA)

log = logging.getLogger("genpool.worker")


def to_engine_prompt(engine, req: JobRequest, tokenizer=None) -> dict:
    """Token ids exactly as LLM.generate / LLM.chat would build them (parity with offline runs),
    computed here so the worker knows the prompt length before admitting."""
    tok = tokenizer or engine.tokenizer
    if req.prompt_token_ids is not None:  # tokenized by the producer: the engine checks the ids
        return {"prompt": None, "prompt_token_ids": list(req.prompt_token_ids)}
    if req.messages is not None:
        msgs = [m.model_dump() for m in req.messages]
        text = engine.apply_chat_template(msgs)
        ids = tok(text, add_special_tokens=False)["input_ids"]
    else:
        text = req.prompt
        ids = tok(text)["input_ids"]
    return {"prompt": text, "prompt_token_ids": list(ids)}


def make_params(req: JobRequest):
    from genpool.engine import SamplingParams  # the engine's own validation has the last word

    return SamplingParams(**req.sampling_kwargs())


def longest_token_chars(tokenizer) -> Optional[int]:
    """Characters of the longest vocabulary entry (byte-level BPE: one char per byte), so that a
    text longer than max_model_len times this is known to be too long without tokenizing it."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    try:
        return max(map(len, get_vocab())) if get_vocab else None
    except (TypeError, ValueError):
        return None


def prepare(engine, job: Job, tokenizer=None, max_chars: Optional[int] = None) -> Job:
    """Build the engine prompt of a valid request (the slow part of admission: chat template and
    tokenizer, seconds for a megabyte); a failure becomes the job's invalid_request error."""
    job.state = JobState.PREPARED
    req = job.req
    if req is None:
        return job
    chars = len(req.prompt or "") + sum(len(m.content) for m in req.messages or [])
    if max_chars is not None and chars > max_chars:
        return _refuse(job, f"prompt is {chars} characters, more than the model's limit of "
                            f"{engine.max_model_len} tokens can hold")
    ids = req.prompt_token_ids  # refused here, before routing hashes its blocks: a 1M-id list held the loop
    if ids is not None and len(ids) >= engine.max_model_len:
        return _refuse(job, f"prompt is {len(ids)} tokens; the model's limit is {engine.max_model_len} "
                            f"including at least one generated token")
    try:
        job.prompt = to_engine_prompt(engine, req, tokenizer)
    except Exception as exc:  # noqa: BLE001 - e.g. a chat template refusing the roles
        return _refuse(job, f"could not build the prompt: {type(exc).__name__}: {exc}")
    return job


def _refuse(job: Job, message: str) -> Job:
    job.error = ErrorEvent(code="invalid_request", message=message)
    return job


class Admitter:
    """The ownership check of a batch of jobs (one round trip), and what each answer means."""

    def __init__(self, r, keys, worker_name: str, max_deliveries: int, job_ttl_s: int,
                 lease_ms: int, resume: bool = True):
        self.r, self.keys, self.name = r, keys, worker_name
        self.max_deliveries, self.job_ttl_s, self.lease_ms = max_deliveries, job_ttl_s, lease_ms
        self.resume = resume  # off: a job taken over restarts (WorkerConfig.resume)

    def claim(self, jobs: list[Job]) -> None:
        """CLAIM_LUA for every job with an id (and a lease on each that writes); sets each job's
        claim, attempt, suspect count and fence. Raises on a lost connection, before any is set."""
        with_id = [j for j in jobs if j.job_id]
        now = f"{time.time():.6f}"
        tokens = {id(j): new_token(self.name) for j in with_id}

        def queue(pipe, j: Job) -> None:
            CLAIM.queue(pipe, [self.keys.job(j.job_id)],
                        [j.entry.entry_id, self.name, now, self.job_ttl_s,
                         "run" if j.ok else "check", tokens[id(j)], self.lease_ms,
                         j.entry.deliveries, self.max_deliveries])
        answers = dict(zip(map(id, with_id), pipelined(self.r, with_id, queue, [CLAIM])))
        for j in jobs:
            self._note(j, answers.get(id(j), (b"dead", b"", 0, 0)), tokens.get(id(j)))

    def _note(self, j: Job, answer, token: Optional[str]) -> None:
        j.state = JobState.CLAIMED
        if refused(answer):  # the script wrote nothing (no lease taken): claim it again
            j.claim, j.detail = Claim.REFUSED, str(answer)
            return
        claimed = not isinstance(answer, Exception)
        if not claimed:  # this job alone (e.g. its hash clobbered): dead-letter the entry,
            log.error("job %s: its ownership claim failed: %s", j.job_id, answer)
            answer = (b"dead", f"its job hash cannot be claimed: {answer}", 0, 0)  # unfenced
        kind, detail, attempt, suspect = answer
        j.claim, j.attempt, j.detail, j.suspect = Claim(field_text(kind)), int(attempt), field_text(detail), int(suspect)
        j.fence = (Fence(token, j.attempt) if claimed and j.claim.writes and token is not None
                   else None)

    def take_over(self, jobs: list[Job], identity) -> None:
        """For every job an earlier attempt ran (attempt > 1, ours to run), read its event log
        and plan the resume (workers/takeover.py): one round trip. Raises on a lost connection.
        With `resume` off, a job that could resume restarts instead (and says so)."""
        todo = [j for j in jobs if j.claim is Claim.RUN and j.attempt > 1]
        for j, entries in zip(todo, read_logs(self.r, self.keys, todo)):
            if isinstance(entries, Exception):  # e.g. a client clobbered the stream's key
                j.takeover = Takeover(restart=f"its event log cannot be read ({entries})")
            else:
                j.takeover = plan(entries, j.req.n, identity)
                if j.takeover.resume is not None and not self.resume:
                    j.takeover = Takeover(restart="resume is off on this worker (--no-resume)")

    @staticmethod
    def settle(j: Job) -> Optional[Outcome]:
        """The end a claim answer means for its job, or None: start it (or queue it to run
        alone). REFUSED is not settled here: the job is held and claimed again."""
        c, e = j.claim, j.entry
        if c is Claim.DEAD:  # no job id, or charged too often
            log.warning("dead-lettering %s %s: %s", e.stream, e.entry_id, j.dead_reason or j.detail)
            return Outcome(End.DEAD, reason=j.dead_reason or j.detail)
        if c in (Claim.DUPLICATE, Claim.FINISHED):
            log.info("job %s (%s): %s, acknowledging without running", j.job_id, e.entry_id,
                     c.value)
            return ACK
        if c is Claim.LEASED:  # reclaimed from a live worker: give the entry straight back
            log.info("job %s is leased by live worker %s; handing its entry back", j.job_id,
                     j.detail)
            return Outcome(End.HANDED_BACK, reason=j.detail)
        if c is Claim.CANCELLED:
            return Outcome.failed("cancelled", "cancelled before it started")
        if c is Claim.CHECK:
            log.info("rejecting job %s: %s", j.job_id, j.error.message)
            return Outcome(End.FAILED, j.error)
        deadline = j.req.deadline
        if deadline is not None and deadline < time.time():
            return Outcome.failed("expired", f"deadline {deadline:.3f} passed "
                                             f"{time.time() - deadline:.3f} s before it started")
        return None


