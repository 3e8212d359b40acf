"""Everything a worker writes to Redis during one step, sent in one pipelined round trip.

Every write for a job is fenced (workers/lease.py, FENCE_LUA): it lands only while this worker's
attempt still owns the job, atomically with the check. A terminal write (result or error) is
acknowledged on its lane stream (XACK + XDEL) in a second round trip, and only when the fenced
write succeeded: an entry is never acknowledged without its result stored, a worker that lost a
job can never acknowledge it, and a crash between the two leaves the entry pending for the next
worker, which finds the job finished and only acknowledges it.
If the round trip fails (Redis gone), `after_failure` turns the lost batch into something safe to
resend: every affected job gets a `restart` plus its whole text so far, then its final writes.
On a Redis Cluster the same holds: each fenced script touches one job's two keys (one slot), the
acks go in their own round trip, and redis-py's cluster pipeline sends one batch per node.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import redis

from genpool.schemas.connection import REDIS_DOWN, is_cluster
from genpool.schemas import ErrorEvent, Keys, ResultEvent, RestartEvent, TokenEvent

from genpool.workers.intake import Entry
from genpool.workers.jobstate import InFlight
from genpool.workers.lease import Fence, fence_call
from genpool.schemas.scripts import FENCE_LUA
from genpool.workers.observe import Observers

log = logging.getLogger("genpool.worker")

# Job hash `state` for each error code; readers rely on these names (docs/protocol.md).
ERROR_STATES = {"cancelled": "cancelled", "expired": "expired", "dead_lettered": "dead"}


@dataclass
class _Op:
    kind: str  # events | final | release | ack | dead
    job_id: Optional[str] = None
    fence: Optional[Fence] = None
    events: list[str] = field(default_factory=list)  # event JSONs
    final: tuple = ()  # (state, field) of a terminal write
    entry: Optional[Entry] = None  # acknowledged once the op (if fenced) landed
    dead: Optional[dict] = None  # dead-letter fields, added with the ack
    job: Optional[InFlight] = None


class Outbox:
    def __init__(self, keys: Keys, worker: str, events_maxlen: int = 16384,
                 result_ttl_s: int = 86400, job_ttl_s: int = 7 * 86400,
                 dead_maxlen: int = 100_000):
        self.keys, self.worker = keys, worker
        self.events_maxlen, self.dead_maxlen = events_maxlen, dead_maxlen
        self.result_ttl_s, self.job_ttl_s = result_ttl_s, job_ttl_s
        self.ops: list[_Op] = []
        self._sha: Optional[str] = None
        # told of every job's end: result() and error() run once per job, resends never do
        self.observers = Observers()

    def __len__(self) -> int:
        return len(self.ops)

    # -- events --------------------------------------------------------------------------
    def _event_json(self, ev, fence: Fence) -> str:
        if ev.type != "restart":
            ev.attempt = fence.attempt
        return ev.model_dump_json(exclude_none=True)

    def token(self, job_id: str, ev: TokenEvent, fence: Fence) -> None:
        self.ops.append(_Op("events", job_id, fence, [self._event_json(ev, fence)]))

    def restart(self, job_id: str, reason: str, fence: Fence) -> None:
        ev = RestartEvent(reason=reason, attempt=fence.attempt)
        self.ops.append(_Op("events", job_id, fence, [self._event_json(ev, fence)]))

    def release(self, job_id: str, fence: Fence) -> None:
        """Hand an unfinished job back (drain timeout): the next worker reruns it uncharged."""
        self.ops.append(_Op("release", job_id, fence))

    # -- terminal writes (each one acknowledged after it landed) --------------------------
    def result(self, job: InFlight, ev: ResultEvent) -> None:
        self.observers.emit("job_finished", job, ev)
        self.ops.append(_Op("final", job.id, job.fence, [self._event_json(ev, job.fence)],
                            ("done", "result"), job.entry, job=job))

    def error(self, job_id: str, entry: Entry, ev: ErrorEvent, fence: Fence,
              job: Optional[InFlight] = None, dead: Optional[dict] = None) -> None:
        state = ERROR_STATES.get(ev.code, "error")
        self.observers.emit("job_failed", job_id, ev, job)
        self.ops.append(_Op("final", job_id, fence, [self._event_json(ev, fence)],
                            (state, "error"), entry, dead, job))

    def ack(self, entry: Entry) -> None:
        """Acknowledge an entry nobody owns a lease on (a duplicate id, a finished job)."""
        self.ops.append(_Op("ack", entry=entry))

    def dead(self, entry: Entry, reason: str, job_id: Optional[str] = None,
             fence: Optional[Fence] = None) -> None:
        """Move an entry to the dead-letter stream; tell its reader when there is one."""
        fields = {"reason": reason[:2000], "stream": entry.stream, "source_entry": entry.entry_id,
                  "deliveries": entry.deliveries, "payload": entry.dead_payload(),
                  "worker": self.worker, "at": f"{time.time():.6f}"}
        if job_id and fence is not None:
            fields["job_id"] = job_id
            self.error(job_id, entry, ErrorEvent(code="dead_lettered", message=reason), fence,
                       dead=fields)
        else:
            self.ops.append(_Op("dead", entry=entry, dead=fields))

    def discard(self, job_id: str) -> None:
        """Forget every queued write for a job this worker no longer holds (they would be
        refused by the fence anyway; not sending them saves the round trip)."""
        self.ops = [op for op in self.ops if op.job_id != job_id]

    # -- sending -------------------------------------------------------------------------
    def take(self) -> list[_Op]:
        ops, self.ops = self.ops, []
        return ops

    def _queue(self, pipe, op: _Op) -> None:
        if op.kind == "events":
            args = [self.events_maxlen, self.job_ttl_s, *op.events]
        elif op.kind == "final":
            args = [self.events_maxlen, self.result_ttl_s, *op.final, f"{time.time():.6f}",
                    self.worker, *op.events]
        else:  # release
            args = []
        fence_call(pipe, self._sha, self.keys, op.job_id, op.fence.token, op.kind, *args)

    def _ack(self, pipe, op: _Op) -> None:
        if op.dead is not None:
            pipe.xadd(self.keys.dead, op.dead, maxlen=self.dead_maxlen, approximate=True)
        if op.entry is not None:  # deleting acked entries keeps XLEN = queued + pending
            pipe.xack(op.entry.stream, self.keys.group, op.entry.entry_id)
            pipe.xdel(op.entry.stream, op.entry.entry_id)

    def send(self, r, ops: list[_Op]) -> set[str]:
        """Send `ops` (fenced writes, then the acks they earned). Returns the ids of jobs whose
        lease is gone (their writes were refused). Raises redis errors on connection loss."""
        fenced = [op for op in ops if op.fence is not None]
        res = self._run_fenced(r, fenced) if fenced else []
        lost: set[str] = set()
        earned = [op for op in ops if op.fence is None]
        for op, x in zip(fenced, res):
            if x == 1:
                if op.kind == "final":
                    earned.append(op)
            elif isinstance(x, Exception):  # e.g. WRONGTYPE on a key a client clobbered
                log.error("job %s: %s write failed: %s", op.job_id, op.kind, x)
            else:
                lost.add(op.job_id)
        if earned:
            pipe = r.pipeline(transaction=False)
            for op in earned:
                self._ack(pipe, op)
            bad = [x for x in pipe.execute(raise_on_error=False) if isinstance(x, Exception)]
            for x in bad:
                if isinstance(x, REDIS_DOWN):
                    raise x
            if bad:
                log.error("%d acknowledgements failed; first: %s", len(bad), bad[0])
        return lost

    def _run_fenced(self, r, ops: list[_Op]) -> list:
        if self._sha is None and not is_cluster(r):
            self._sha = r.script_load(FENCE_LUA)
        pipe = r.pipeline(transaction=False)
        for op in ops:
            self._queue(pipe, op)
        res = pipe.execute(raise_on_error=False)
        retry = [i for i, x in enumerate(res) if isinstance(x, redis.exceptions.NoScriptError)]
        if retry:  # Redis restarted or flushed its scripts: load it and send those again
            self._sha = r.script_load(FENCE_LUA)
            pipe = r.pipeline(transaction=False)
            for i in retry:
                self._queue(pipe, ops[i])
            for i, x in zip(retry, pipe.execute(raise_on_error=False)):
                res[i] = x
        for x in res:
            if isinstance(x, REDIS_DOWN):
                raise x
        return res

    def flush(self, r) -> set[str]:
        """Send everything now (on failure the ops stay queued for after_failure)."""
        lost = self.send(r, self.ops)
        self.ops = []
        return lost

    def after_failure(self, live: list[InFlight]) -> None:
        """The last flush may or may not have landed: make a resend idempotent for readers."""
        keep = [op for op in self.ops if op.kind != "events"]
        self.ops = []
        jobs = {j.id: j for j in live}
        jobs.update({op.job.id: op.job for op in keep if op.job is not None})
        for job in jobs.values():
            self.restart(job.id, "worker lost its Redis connection; resending", job.fence)
            for ev in job.replay_events():
                self.token(job.id, ev, job.fence)
        self.ops += keep
