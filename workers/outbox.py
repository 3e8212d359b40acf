"""Everything a worker writes to Redis during one step, sent as ONE MULTI/EXEC pipeline.

One round trip per step keeps Redis off the engine's critical path, and MULTI makes "write the
result, then XACK" atomic: an entry is never acknowledged without its result stored, and a result
is never stored without the acknowledgement (which would rerun a finished job after a crash).
If the round trip fails (Redis gone), `after_failure` turns the lost batch into something safe to
resend: every affected job gets a `restart` plus its whole text so far, then its final writes.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

from schemas import ErrorEvent, Keys, ResultEvent, RestartEvent, TokenEvent

from .intake import Entry
from .jobstate import InFlight
from .observe import Observers

log = logging.getLogger("genpool.worker")

# Job hash `state` for each error code; readers rely on these names (docs/protocol.md).
ERROR_STATES = {"cancelled": "cancelled", "expired": "expired", "dead_lettered": "dead"}


@dataclass
class _Op:
    kind: str  # token | restart | final | dead | ack
    apply: Callable
    job: Optional[InFlight] = None


class Outbox:
    def __init__(self, keys: Keys, worker: str, events_maxlen: int = 16384,
                 result_ttl_s: int = 86400, job_ttl_s: int = 7 * 86400,
                 dead_maxlen: int = 100_000):
        self.keys, self.worker = keys, worker
        self.events_maxlen, self.dead_maxlen = events_maxlen, dead_maxlen
        self.result_ttl_s, self.job_ttl_s = result_ttl_s, job_ttl_s
        self.ops: list[_Op] = []
        self._ttl_set: set[str] = set()  # event streams that already carry a TTL
        # told of every job's end: result() and error() run once per job, resends never do
        self.observers = Observers()

    def __len__(self) -> int:
        return len(self.ops)

    # -- events --------------------------------------------------------------------------
    def _event(self, pipe, job_id: str, ev) -> None:
        key = self.keys.events(job_id)
        pipe.xadd(key, {"event": ev.model_dump_json(exclude_none=True)},
                  maxlen=self.events_maxlen, approximate=True)
        if job_id not in self._ttl_set:  # bound a stream whose job never finishes
            pipe.expire(key, self.job_ttl_s)
            self._ttl_set.add(job_id)

    def token(self, job_id: str, ev: TokenEvent) -> None:
        self.ops.append(_Op("token", lambda p: self._event(p, job_id, ev)))

    def restart(self, job_id: str, reason: str, attempt: int) -> None:
        ev = RestartEvent(reason=reason, attempt=attempt)
        self.ops.append(_Op("restart", lambda p: self._event(p, job_id, ev)))

    # -- terminal writes (each one acknowledges its entry in the same MULTI) -------------
    def _finish(self, pipe, job_id: str, entry: Entry, ev, state: str, field: str) -> None:
        self._event(pipe, job_id, ev)
        job_key = self.keys.job(job_id)
        pipe.hset(job_key, mapping={"state": state, field: ev.model_dump_json(exclude_none=True),
                                    "finished_at": f"{time.time():.6f}", "worker": self.worker})
        pipe.expire(job_key, self.result_ttl_s)
        pipe.expire(self.keys.events(job_id), self.result_ttl_s)
        self._ack(pipe, entry)
        self._ttl_set.discard(job_id)

    def _ack(self, pipe, entry: Entry) -> None:
        # Deleting acked entries keeps lane streams bounded (and XLEN = queued + pending).
        pipe.xack(entry.stream, self.keys.group, entry.entry_id)
        pipe.xdel(entry.stream, entry.entry_id)

    def result(self, job: InFlight, ev: ResultEvent) -> None:
        self.observers.emit("job_finished", job, ev)
        self.ops.append(_Op("final", lambda p: self._finish(p, job.id, job.entry, ev, "done",
                                                            "result"), job))

    def error(self, job_id: str, entry: Entry, ev: ErrorEvent,
              job: Optional[InFlight] = None) -> None:
        state = ERROR_STATES.get(ev.code, "error")
        self.observers.emit("job_failed", job_id, ev, job)
        self.ops.append(_Op("final", lambda p: self._finish(p, job_id, entry, ev, state, "error"),
                            job))

    def ack(self, entry: Entry) -> None:
        self.ops.append(_Op("ack", lambda p: self._ack(p, entry)))

    def dead(self, entry: Entry, reason: str, job_id: Optional[str] = None) -> None:
        """Move an entry to the dead-letter stream; tell its reader when there is one."""
        fields = {"reason": reason[:2000], "stream": entry.stream, "source_entry": entry.entry_id,
                  "deliveries": entry.deliveries, "payload": entry.dead_payload(),
                  "worker": self.worker, "at": f"{time.time():.6f}"}
        if job_id:
            fields["job_id"] = job_id

        def apply(pipe):
            pipe.xadd(self.keys.dead, fields, maxlen=self.dead_maxlen, approximate=True)
            if not job_id:
                self._ack(pipe, entry)

        self.ops.append(_Op("dead", apply))
        if job_id:
            self.error(job_id, entry, ErrorEvent(code="dead_lettered", message=reason))

    # -- sending -------------------------------------------------------------------------
    def take(self) -> list[_Op]:
        ops, self.ops = self.ops, []
        return ops

    def send(self, r, ops: list[_Op]) -> None:
        """Send `ops` in one MULTI round trip. Raises redis errors on connection loss."""
        if not ops:
            return
        pipe = r.pipeline(transaction=True)
        for op in ops:
            op.apply(pipe)
        results = pipe.execute(raise_on_error=False)
        bad = [res for res in results if isinstance(res, Exception)]
        if bad:  # e.g. WRONGTYPE on a key a client clobbered; the rest of the MULTI still ran
            log.error("%d of %d writes failed this step; first: %s", len(bad), len(results), bad[0])

    def flush(self, r) -> None:
        """Send everything now (on failure the ops stay queued for after_failure)."""
        self.send(r, self.ops)
        self.ops = []

    def after_failure(self, live: list[InFlight]) -> None:
        """The last flush may or may not have landed: make a resend idempotent for readers."""
        keep = [op for op in self.ops if op.kind in ("final", "dead", "ack")]
        self.ops, self._ttl_set = [], set()
        jobs = {j.id: j for j in live}
        jobs.update({op.job.id: op.job for op in keep if op.job is not None})
        for job in jobs.values():
            self.restart(job.id, "worker lost its Redis connection; resending", job.attempt)
            for ev in job.replay_events():
                self.token(job.id, ev)
        self.ops += keep

