"""What a worker holds and how it lets go: leases, suspect jobs run alone, jobs lost to another
worker, cancels, and the intake of new entries (prepared inline or on the preparer's thread).

A mixin of Worker (workers/worker.py), kept apart so the loop reads top to bottom; it uses the
worker's engine, outbox, admitter, inflight map and counters, and Recovery's handling of writes
Redis refused (workers/recovery.py).
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Optional

from genpool.schemas import ErrorEvent
from genpool.workers.admission import SOLO_AFTER, Verdict, longest_token_chars, prepare
from genpool.workers.intake import Entry, Parsed, parse_entry
from genpool.workers.lease import Lease, LeaseKeeper
from genpool.workers.preparer import Preparer, private_tokenizer
from genpool.workers.publisher import Publisher
from genpool.workers.streams import WritesRefused

log = logging.getLogger("genpool.worker")


class Intake(Preparer):
    """The preparer, plus the prepared entries whose ownership claim Redis refused (a write
    refused: OOM, NOREPLICAS). They stay held (kept fresh: a reclaim would count a delivery of
    a job that never ran, and enough of those dead-letter it) and are claimed again with the
    next admission; they count as pending, so the worker pulls no more than it can run."""

    def __init__(self, prepare):
        super().__init__(prepare)
        self.unclaimed: list[Parsed] = []

    @property
    def pending(self) -> int:
        return super().pending + len(self.unclaimed)

    def ready(self) -> list[Parsed]:
        out, self.unclaimed = self.unclaimed + super().ready(), []
        return out


class Custody:
    def _init_custody(self, engine, r, keys, cfg) -> None:
        # leases are renewed (and the heartbeat sent) by a thread of their own: a slow step or
        # a blocked loop never lets another worker take over a live job (workers/lease.py)
        self.keeper = LeaseKeeper(r, keys, self.name, cfg.claim_idle_ms,
                                  min(cfg.heartbeat_s, cfg.claim_idle_ms / 3000),
                                  self._beat)
        self.publisher = Publisher(self.outbox, r, self.keeper)
        tok = engine.tokenizer
        longest = longest_token_chars(tok)  # 2x: room for a normalizer that shortens text
        self.max_prompt_chars = 2 * longest * engine.max_model_len if longest else None
        own_tok = private_tokenizer(tok)
        self.preparer = Intake(lambda e: prepare(engine, parse_entry(e, cfg.served_models),
                                                 own_tok, self.max_prompt_chars))
        # jobs that shared the batches of two lost workers run alone, one at a time (CLAIM_LUA)
        self.solo_queue: deque[Verdict] = deque()
        self.solo_job: Optional[str] = None

    def _beat(self) -> None:  # the lease thread's heartbeat (and prefix-index freshness)
        self.heartbeat.beat(self.status())
        self.router.touch()

    def cancel(self, job_ids: list[str]) -> None:
        for job_id in job_ids:
            if job_id in self.inflight:
                self._abort(job_id, ErrorEvent(code="cancelled", message="cancelled by request"))
            for v in [v for v in self.solo_queue if v.parsed.job_id == job_id]:
                self.solo_queue.remove(v)
                self.outbox.error(job_id, v.parsed.entry, ErrorEvent(
                    code="cancelled", message="cancelled by request"), v.fence)
                self.keeper.drop(v.parsed.entry, job_id)

    def admit(self, entries: list[Entry]) -> None:
        """Hold every new entry (its idle time kept fresh), prepare small ones here and big ones
        on the preparer's thread, then claim and start whatever is prepared."""
        parsed: list[Parsed] = []
        for e in entries:
            if e.origin != "handed":  # handed-off entries were held as soon as they came
                if self.keeper.holds(e):  # ours already (a reclaim can return our own entry)
                    continue
                self.keeper.hold(e)
                self.router.note(e)
            if Preparer.is_big(e):
                self.preparer.submit(e)
            else:
                parsed.append(prepare(self.engine, parse_entry(e, self.cfg.served_models),
                                      None, self.max_prompt_chars))
        parsed += self.preparer.ready()
        parsed = self.router.route(parsed)  # new jobs a peer caches more of go to that peer
        if not parsed:
            return
        unsettled = {id(p.entry): p for p in parsed}
        try:
            verdicts = self.admitter.verdicts(parsed)
            for v in verdicts:
                self._settle(v)
                del unsettled[id(v.parsed.entry)]
        except BaseException:
            # Redis went away mid-admission. What is left must not be kept fresh, or it would
            # never go idle and be reclaimed (by us or a peer) after claim_idle_ms: it would
            # wait forever. A claim that landed unseen just expires, as a lost worker's would.
            for p in unsettled.values():
                self.keeper.drop(p.entry, p.job_id)
            raise
        refusals = [v.detail for v in verdicts if v.kind == "refused"]
        if refusals:  # claimed again at the next admission; an idle loop waits a moment first
            # (not raised: the rest of this step, the sending of its results included, goes on)
            self._writes_refused(WritesRefused(f"{len(refusals)} claims refused; first: "
                                               f"{refusals[0]}"),
                                 pause=not self.engine.has_unfinished_requests())

    def _settle(self, v: Verdict) -> None:
        if v.kind == "refused":  # nothing written, no lease taken: held, and claimed again
            v.parsed.entry.origin = ""  # routed once already: not handed off on the retry
            self.preparer.unclaimed.append(v.parsed)
            return
        self.observers.emit("job_received", v)
        e, job_id = v.parsed.entry, v.parsed.job_id
        if v.fence is not None:
            self.keeper.grant(Lease(job_id, e, v.fence.token))
        if self.admitter.settle(v) is None:
            self.keeper.drop(e, job_id)
        elif v.suspect >= SOLO_AFTER:
            log.warning("job %s shared the batch of %d lost workers: running it alone",
                        job_id, v.suspect)
            self.solo_queue.append(v)
        else:
            self._start(v)

    def _start(self, v: Verdict) -> None:
        job = self.admitter.start(self.engine, v)
        if job is None:
            self.keeper.drop(v.parsed.entry, v.parsed.job_id)
            return
        self.inflight[job.id] = job
        self.observers.emit("job_started", job)

    def run_solo(self) -> None:
        if self.solo_job is not None and self.solo_job not in self.inflight:
            self.solo_job = None
        if (self.solo_job is not None or not self.solo_queue or self.inflight
                or self.engine.has_unfinished_requests()):
            return
        # the previous solo job's result must have landed first: were this worker lost with it
        # still pending, that job (marked solo) would be charged for the next one's crash
        self.publisher.wait()
        self.publisher.submit(self.outbox.take())
        self.publisher.wait()
        v = self.solo_queue[0]
        # recorded before its first step: if this worker is lost now, the job alone is charged
        # (a Redis loss raises here with the job still queued: it is tried again after)
        ok = self.keeper.call(v.parsed.job_id, v.fence.token, "solo")
        self.solo_queue.popleft()
        if ok != 1:
            self.keeper.drop(v.parsed.entry, v.parsed.job_id)
            return
        self._start(v)
        if v.parsed.job_id in self.inflight:
            self.solo_job = v.parsed.job_id

    def drop_lost(self) -> None:
        for job_id in self.keeper.take_lost():
            job = self.inflight.pop(job_id, None)
            queued = [v for v in self.solo_queue if v.parsed.job_id == job_id]
            for v in queued:
                self.solo_queue.remove(v)
            if job is None and not queued:
                continue
            log.warning("job %s: another worker holds it now; dropping it unanswered", job_id)
            self.counts["lost"] += 1
            if job is not None:
                self.engine.abort_request(job.engine_id)
                self.keeper.drop(job.entry, job_id)
            for v in queued:
                self.keeper.drop(v.parsed.entry, job_id)
            self.outbox.discard(job_id)

    def _release_unfinished(self) -> None:
        """Jobs still running at the drain deadline stay unacknowledged: after claim_idle_ms
        another worker reclaims them and reruns them (their readers see a restart). They are
        released (a fenced write), so that rerun is not counted against them."""
        if self.inflight or self.solo_queue:
            log.warning("releasing %d unfinished jobs to other workers",
                        len(self.inflight) + len(self.solo_queue))
            self.engine.abort_request([job.engine_id for job in self.inflight.values()])
            for job in self.inflight.values():
                self.outbox.release(job.id, job.fence)
            for v in self.solo_queue:
                self.outbox.release(v.parsed.job_id, v.fence)
            self.inflight.clear()
            self.solo_queue.clear()
