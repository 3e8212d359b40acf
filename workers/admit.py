"""Admission: from lane entries to running jobs. Hold each entry, prepare it (inline, or on the
preparer's thread when big), route it (a peer may cache more of its prompt), claim it, and settle
the claim: start it, queue it to run alone, or end it through JobTable.finish.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

from genpool.workers.admission import SOLO_AFTER, Admitter, longest_token_chars, prepare
from genpool.workers.caps import ConcurrencyCaps
from genpool.workers.intake import parse_entry
from genpool.workers.job import LET_GO, Claim, Entry, Job
from genpool.workers.jobs import JobTable
from genpool.workers.lease import LeaseKeeper
from genpool.workers.observe import Observers
from genpool.workers.preparer import Preparer, private_tokenizer
from genpool.workers.streams import WritesRefused

log = logging.getLogger("genpool.worker")


class Intake(Preparer):
    """The preparer, plus the prepared jobs held back: those whose ownership claim Redis
    refused (a write refused: OOM, NOREPLICAS), and those whose tenant is at its concurrency
    cap. Both stay held (kept fresh: a reclaim would count a delivery of a job that never ran,
    and enough of those dead-letter it) and are tried again with the next admission. Refused
    claims count as pending, so the worker pulls no more than it can run. Capped jobs do not:
    they cannot run until their tenant's own jobs end, and counted, the few entries of one
    read kept the worker from pulling any other tenant's work (fair pull skips the full tenant
    meanwhile, so they stay as many as that one read took)."""

    def __init__(self, prepare):
        super().__init__(prepare)
        self.unclaimed: list[Job] = []
        self.capped: list[Job] = []

    @property
    def pending(self) -> int:
        return super().pending + len(self.unclaimed)

    def ready(self) -> list[Job]:
        out = self.unclaimed + self.capped + super().ready()
        self.unclaimed, self.capped = [], []
        return out


class Admission:
    def __init__(self, engine, served_models: frozenset[str], admitter: Admitter,
                 jobs: JobTable, keeper: LeaseKeeper, router, observers: Observers,
                 refused: Callable[[WritesRefused, bool], None],
                 caps: Optional[ConcurrencyCaps] = None):
        self.engine, self.served = engine, served_models
        self.caps = caps  # tenants' concurrency caps (workers/caps.py)
        self.admitter, self.jobs, self.keeper, self.router = admitter, jobs, keeper, router
        self.observers, self._refused = observers, refused
        longest = longest_token_chars(engine.tokenizer)  # 2x: room for a normalizer that
        self.max_prompt_chars = 2 * longest * engine.max_model_len if longest else None  # shortens
        own_tok = private_tokenizer(engine.tokenizer)  # the thread's (the loop detokenizes)
        self.preparer = Intake(lambda e: prepare(engine, parse_entry(e, served_models), own_tok,
                                                 self.max_prompt_chars))

    def admit(self, entries: list[Entry]) -> None:
        """Hold every new entry (its idle time kept fresh), prepare small ones here and big ones
        on the preparer's thread, then claim and start whatever is prepared."""
        jobs: list[Job] = []
        for e in entries:
            if e.origin != "handed":  # handed-off entries were held as soon as they came
                if self.keeper.holds(e):  # ours already (a reclaim can return our own entry)
                    continue
                self.keeper.hold(e)
                self.router.inbox.note(e)  # ours, never a hand-off
            if Preparer.is_big(e):
                self.preparer.submit(e)
            else:
                jobs.append(prepare(self.engine, parse_entry(e, self.served), None,
                                    self.max_prompt_chars))
        jobs += self.preparer.ready()
        jobs = self.router.route(jobs)  # new jobs a peer caches more of go to that peer
        jobs = self._within_caps(jobs)
        if not jobs:
            return
        try:
            self.admitter.claim(jobs)
            self.admitter.take_over(jobs, self.jobs.identity)  # resume where they stopped
        except BaseException:
            # Redis went away mid-admission. What is left must not be kept fresh, or it would
            # never go idle and be reclaimed (by us or a peer) after claim_idle_ms: it would
            # wait forever. A claim that landed unseen just expires, as a lost worker's would.
            for j in jobs:
                self.keeper.drop(j.entry, j.job_id)
                if self.caps is not None:
                    self.caps.release(j.job_id)
            raise
        self._settle_all(jobs)

    def _within_caps(self, jobs: list[Job]) -> list[Job]:
        """The jobs whose tenant has a concurrency slot for them; the others stay held (kept
        fresh, not counted as pending: Intake) and are tried again with the next admission."""
        if self.caps is None or not jobs:
            return jobs
        try:
            waiting = {id(j) for j in self.caps.acquire(jobs)}
        except BaseException:
            for j in jobs:  # as in admit(): let go, not kept fresh
                self.keeper.drop(j.entry, j.job_id)
            raise
        for j in jobs:
            if id(j) in waiting:
                j.entry.origin = ""  # routed once already
                self.preparer.capped.append(j)
        return [j for j in jobs if id(j) not in waiting]

    def _settle_all(self, jobs: list[Job]) -> None:
        unsettled = {id(j): j for j in jobs}
        try:
            for j in jobs:
                self._settle(j)
                del unsettled[id(j)]
        except BaseException:  # as above: a job not settled yet is let go, not kept fresh
            for j in unsettled.values():
                self.jobs.finish(j, LET_GO)
            raise
        refusals = [j.detail for j in jobs if j.claim is Claim.REFUSED]
        if refusals:  # claimed again at the next admission; an idle loop waits a moment first
            # (not raised: the rest of this step, the sending of its results included, goes on)
            self._refused(WritesRefused(f"{len(refusals)} claims refused; first: {refusals[0]}"),
                          not self.engine.has_unfinished_requests())

    def _settle(self, j: Job) -> None:
        if j.claim is Claim.REFUSED:  # nothing written, no lease taken: held, claimed again
            j.entry.origin = ""  # routed once already: not handed off on the retry
            self.preparer.unclaimed.append(j)
            return
        self.observers.emit("job_received", j)
        if j.fence is not None:
            self.keeper.grant(j)
        outcome = self.admitter.settle(j)
        if outcome is not None:
            self.jobs.finish(j, outcome)
        elif j.suspect >= SOLO_AFTER:
            self.jobs.queue_solo(j)
        else:
            self.jobs.start(j)

    def run_solo(self, flush: Callable[[], None]) -> None:
        """Start the next suspect job once the engine is empty. `flush` sends every write so far
        and waits for it: the previous solo job's result must have landed first (were this
        worker lost with it still pending, that job, marked solo, would be charged for the next
        one's crash)."""
        jobs = self.jobs
        if jobs.solo_job is not None and jobs.solo_job not in jobs.running:
            jobs.solo_job = None
        if (jobs.solo_job is not None or not jobs.solo or len(jobs)
                or self.engine.has_unfinished_requests()):
            return
        flush()
        j = jobs.solo[0]
        # recorded before its first step: if this worker is lost now, the job alone is charged
        # (a Redis loss raises here with the job still queued: it is tried again after)
        ok = self.keeper.call(j.job_id, j.fence.token, "solo")
        jobs.solo.popleft()
        if ok != 1:
            jobs.finish(j, LET_GO)  # its lease is gone: the next reclaim finds it
            return
        if jobs.start(j):
            jobs.solo_job = j.job_id

    @property
    def pending(self) -> int:
        return self.preparer.pending

    def close(self) -> None:
        self.preparer.close()
