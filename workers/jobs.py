"""The jobs a worker holds past their claim: running in the engine, or waiting to run alone.

`JobTable` owns them, and every job ends through its one `finish(job, outcome)`: out of the
table, out of the engine (unless the engine ended it), its one write queued in the outbox (or
none, for a lost lease), its entry and lease let go, and the count. As vLLM's scheduler frees
every request through one `_free_request`, nothing else removes a job or writes its end.
"""
from __future__ import annotations

import logging
import math
import time
from collections import deque
from typing import Callable, Iterator, Optional

import redis

from genpool.engine.protocol import Engine, EngineStats
from genpool.schemas.connection import REDIS_DOWN
from genpool.schemas.events import PromptScores
from genpool.workers.admission import make_params, to_engine_prompt
from genpool.workers.job import End, Job, JobState, Outcome, engine_request_id, job_id_of
from genpool.workers.lease import LeaseKeeper
from genpool.workers.observe import Observers
from genpool.workers.outbox import Outbox
from genpool.workers.streams import refused
from genpool.workers.takeover import Takeover

log = logging.getLogger("genpool.worker")
COUNTED = {End.DONE: "done", End.FAILED: "failed", End.LOST: "lost"}  # for jobs that ran
TOKEN_TEXT_CACHE = 65536  # token texts a worker keeps (the vocabulary of most models fits)


class JobTable:
    def __init__(self, engine: Engine, outbox: Outbox, keeper: LeaseKeeper, r, keys, name: str,
                 observers: Observers, counts: dict,
                 ended: Optional[Callable[[Optional[str]], None]] = None):
        self.engine, self.outbox, self.keeper = engine, outbox, keeper
        self.ended = ended  # told every job id that ends here (workers/caps.py frees its slot)
        self.r, self.keys, self.name = r, keys, name
        self.observers, self.counts = observers, counts
        self.running: dict[str, Job] = {}
        self.solo: deque[Job] = deque()  # suspect jobs: each runs alone, once the engine is empty
        self.solo_job: Optional[str] = None  # the suspect job running now
        # what this engine's output depends on: recorded with each job's first token, compared
        # by a worker that takes the job over (workers/takeover.py)
        self.identity = engine.model_identity()
        self.identity_doc = self.identity.to_dict()
        self._texts: dict[str, str] = {}  # token id -> its text (token_texts)

    def token_texts(self, logprobs: list[dict[str, float]]) -> dict[str, str]:
        """Each id in these logprob maps decoded alone (cached: the same few thousand ids come
        back), for readers without the tokenizer."""
        out = {}
        for k in {k for d in logprobs for k in d}:
            text = self._texts.get(k)
            if text is None:
                text = self.engine.tokenizer.decode([int(k)])
                if len(self._texts) < TOKEN_TEXT_CACHE:
                    self._texts[k] = text
            out[k] = text
        return out

    def prompt_scores(self, ids: list[int], lps: list, prompt: Optional[str]) -> PromptScores:
        """The engine's prompt logprobs in the wire's shape, with the text of every id, and the
        prompt's text when it came as token ids (`prompt` None)."""
        maps = [None if d is None else {str(k): float(v) for k, v in d.items()} for d in lps]
        texts = self.token_texts([d for d in maps if d] + [{str(t): 0.0 for t in ids[:1]}])
        text = self.engine.tokenizer.decode(list(ids)) if prompt is None else None
        return PromptScores(token_ids=list(ids), logprobs=maps, token_texts=texts, text=text)

    def __len__(self) -> int:
        return len(self.running)

    def __iter__(self) -> Iterator[Job]:
        return iter(list(self.running.values()))

    def of_output(self, engine_id: str) -> Optional[Job]:
        """The running job an engine output belongs to; None for a job already answered
        (cancelled, expired), or for an earlier attempt's output (its lease was lost, then this
        worker reran the job under a new engine id)."""
        job = self.running.get(job_id_of(engine_id))
        return job if job is not None and job.engine_id == engine_id else None

    def find(self, job_id: str) -> list[Job]:
        """The running and solo-queued jobs with this id."""
        found = [j for j in self.solo if j.job_id == job_id]
        return ([self.running[job_id]] if job_id in self.running else []) + found

    @property
    def solo_busy(self) -> bool:
        """A suspect job waits to run alone, or runs alone: nothing else may start."""
        if self.solo_job is not None and self.solo_job not in self.running:
            self.solo_job = None
        return bool(self.solo) or self.solo_job is not None

    # -- starting ----------------------------------------------------------------------------
    def start(self, job: Job) -> bool:
        """add_request, resuming after what an earlier attempt published where it can; a
        request the engine refuses ends as the job's error."""
        req = job.req
        engine_id = engine_request_id(req.id)
        try:
            prompt = job.prompt or to_engine_prompt(self.engine, req)
            self._add(job, engine_id, prompt)
        except ValueError as exc:
            self.finish(job, Outcome.failed("invalid_request", str(exc)))
            return False
        except Exception as exc:  # an engine bug must not take the worker down
            log.exception("engine refused job %s", req.id)
            self.finish(job, Outcome.failed("internal", f"{type(exc).__name__}: {exc}"))
            return False
        job.prompt_tokens = n_prompt = len(prompt["prompt_token_ids"])
        job.engine_id, job.admitted_at, job.state = engine_id, time.time(), JobState.RUNNING
        job.max_len = min(n_prompt + req.max_tokens, self.engine.max_model_len)
        self.running[job.id] = job
        self._tell_reader(job)
        self.observers.emit("job_started", job)
        return True

    def _add(self, job: Job, engine_id: str, prompt: dict) -> None:
        params, t = make_params(job.req), job.takeover
        if t is not None and t.resume is not None:
            try:
                self.engine.add_request(engine_id, prompt, params, priority=job.req.priority,
                                        resume=t.resume)
                return
            except ValueError as exc:  # a log this engine could not have written
                job.takeover = Takeover(restart=f"{exc}: rerun from the start")
        self.engine.add_request(engine_id, prompt, params, priority=job.req.priority)

    def _tell_reader(self, job: Job) -> None:
        """A resumed job's reader gets a `resume` (a no-op for one that saw the whole log); a
        rerun's, a `restart` saying why, when an earlier attempt published anything."""
        t = job.takeover
        if t is None:
            return
        if t.resume is not None:
            job.prime(t)
            self.outbox.resume(job, t.tokens)
            log.info("job %s: resumed (attempt %d) after %d tokens", job.id, job.attempt,
                     t.resume.num_tokens)
        elif t.restart:
            log.info("job %s: rerun (attempt %d): %s", job.id, job.attempt, t.restart)
            self.outbox.restart(job, f"attempt {job.attempt}: {t.restart}")

    def queue_solo(self, job: Job) -> None:
        log.warning("job %s shared the batch of %d lost workers: running it alone", job.job_id,
                    job.suspect)
        job.state = JobState.SOLO
        self.solo.append(job)

    # -- ending ------------------------------------------------------------------------------
    def finish(self, job: Job, outcome: Outcome, engine_ended: bool = False) -> None:
        """The one way a job ends (see the module docstring). `engine_ended`: the engine itself
        finished the request (a result, or its own error), so there is nothing to abort."""
        was = job.state
        if was is JobState.ENDED:
            return
        job.state = JobState.ENDED
        if self.running.get(job.job_id) is job:
            del self.running[job.job_id]
            if not engine_ended:
                self.engine.abort_request(job.engine_id)
        if job in self.solo:
            self.solo.remove(job)
        self._write(job, outcome)
        self.keeper.drop(job.entry, job.job_id)
        if self.ended is not None:
            self.ended(job.job_id)
        name = COUNTED.get(outcome.end)
        if name and (was is JobState.RUNNING or (name == "lost" and was is JobState.SOLO)):
            self.counts[name] += 1

    def _write(self, job: Job, outcome: Outcome) -> None:
        end = outcome.end
        if end is End.DONE:
            self.outbox.result(job, job.result(self.name))
        elif end is End.FAILED:
            self.outbox.error(job, outcome.error)
        elif end is End.DEAD:
            self.outbox.dead(job, outcome.reason, tell_reader=job.dead_reason is None)
        elif end is End.ACK:
            self.outbox.ack(job)
        elif end is End.RELEASED:
            self.outbox.release(job)
        elif end is End.LOST:
            log.warning("job %s: another worker holds it now; dropping it unanswered", job.job_id)
            self.outbox.discard(job.job_id)
        elif end is End.HANDED_BACK:
            self._hand_back(job, outcome.reason)

    def _hand_back(self, job: Job, holder: str) -> None:
        e = job.entry
        try:
            self.r.xclaim(e.stream, self.keys.group, holder or self.name, 0, [e.entry_id],
                          justid=True)
        except redis.RedisError as exc:  # it stays in our pending list, unheld: reclaimed
            if not (isinstance(exc, REDIS_DOWN) or refused(exc)):  # later; go on with the
                raise                                               # rest
            log.warning("job %s: hand-back failed (%s)", job.job_id, exc)

    # -- ends the loop asks for -------------------------------------------------------------
    def cancel(self, job_ids: list[str]) -> None:
        for job_id in job_ids:
            for job in self.find(job_id):
                self.finish(job, Outcome.failed("cancelled", "cancelled by request"))

    def expire(self) -> None:
        now = time.time()
        for job in self:
            if job.req.deadline is not None and job.req.deadline < now:
                self.finish(job, Outcome.failed(
                    "expired", f"deadline passed after {job.generated} generated tokens"))

    def drop_lost(self, job_ids: list[str]) -> None:
        """Jobs whose lease another worker took: abort, write nothing."""
        for job_id in job_ids:
            for job in self.find(job_id):
                self.finish(job, Outcome(End.LOST))

    def release_all(self) -> None:
        """Jobs still running at the drain deadline are handed over: released (a fenced write,
        so the next attempt is not counted against them) and marked long idle (Outbox.send), so
        a peer's next reclaim check takes them and resumes each after the tokens it published."""
        left = list(self.running.values()) + list(self.solo)
        if left:
            log.warning("releasing %d unfinished jobs to other workers", len(left))
        for job in left:
            self.finish(job, Outcome(End.RELEASED))

    # -- capacity ----------------------------------------------------------------------------
    def free(self, max_seqs: int, kv_total: int, block_size: int) -> int:
        """Jobs that still fit (see free_capacity); none while a suspect job waits or runs."""
        if self.solo_busy:
            return 0
        return free_capacity(self.engine.stats(), list(self.running.values()), max_seqs,
                             kv_total, block_size)


def blocks_needed(job: Job, block_size: int, kv_total: int) -> int:
    """A bound on the KV blocks a job can hold: its prompt once (its n samples share its
    blocks) and each sample's tokens to the model's length (job.max_len caps prompt +
    max_tokens), at most half the cache. Uncapped, one job of n=16 counted more than the whole
    cache and the worker pulled nothing else while it ran; past its bound the engine preempts
    and recomputes instead."""
    prompt = job.prompt_tokens // block_size  # whole blocks: shared (a partial one is copied)
    per_sample = math.ceil(job.max_len / block_size) - prompt
    return min(prompt + job.req.n * per_sample, max(1, kv_total // 2))


def free_capacity(stats: EngineStats, running: list[Job], max_seqs: int, kv_total: int,
                  block_size: int) -> int:
    """Jobs that still fit: free sequence slots (n per job), and KV blocks for the worst case of
    the jobs held (sized by their average, since unread jobs' sizes are unknown)."""
    seqs = sum(j.req.n for j in running)
    slots = min(stats.free_seq_slots, max_seqs - seqs)
    held = [blocks_needed(j, block_size, kv_total) for j in running]
    per_job = max(1, sum(held) // len(held)) if held else 1
    kv_room = (kv_total - sum(held)) // per_job
    return max(0, min(slots, kv_room))
