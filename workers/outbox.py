"""Everything a worker writes to Redis during one step, sent in one pipelined round trip.

Every write for a job is fenced (workers/lease.py, FENCE_LUA): it lands only while this worker's
attempt still owns the job, atomically with the check. A job's ops in one batch go in one fenced
call (its tokens and the result after them land together, or not at all). A terminal write
(result or error) is acknowledged on its lane stream (ACK_LUA: XACK + XDEL, with the dead letter
if there is one, first) in a second round trip, and only when the fenced write succeeded: an
entry is never acknowledged without its result stored, a worker that lost a job can never
acknowledge it, and a crash between the two leaves the entry pending for the next worker, which
finds the job finished and only acknowledges it.
A write Redis refuses (OOM under memory pressure, NOREPLICAS, READONLY: workers/streams.py) wrote
nothing, so `send` hands it back, in order, to be sent again as it was; its entry stays pending.
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

from genpool.schemas import ErrorEvent, Keys, RestartEvent, ResultEvent, TokenEvent
from genpool.schemas.connection import REDIS_DOWN, is_cluster
from genpool.schemas.keys import hash_tag
from genpool.schemas.scripts import ACK_LUA, FENCE_LUA
from genpool.workers.intake import Entry
from genpool.workers.jobstate import InFlight
from genpool.workers.lease import Fence, fence_call
from genpool.workers.observe import Observers
from genpool.workers.streams import WritesRefused, refused

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
    refusal: Optional[Exception] = None  # Redis refused it (last time it was sent)
    held: bool = False  # queued again after a refusal, its entry (and lease) held meanwhile


class Outbox:
    def __init__(self, keys: Keys, worker: str, events_maxlen: int = 16384,
                 result_ttl_s: int = 86400, job_ttl_s: int = 7 * 86400,
                 dead_maxlen: int = 100_000):
        self.keys, self.worker = keys, worker
        self.events_maxlen, self.dead_maxlen = events_maxlen, dead_maxlen
        self.result_ttl_s, self.job_ttl_s = result_ttl_s, job_ttl_s
        self.ops: list[_Op] = []
        self._shas: dict[str, str] = {}  # script -> SHA loaded on this server (not on a cluster)
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

    @staticmethod
    def _calls(ops: list[_Op]) -> list[list[_Op]]:
        """The fenced calls for `ops`: a job's events, and the final write after them, go in
        one call, so Redis applies or refuses them together (a result can never land when a
        token before it was refused). A release, or another attempt's op, starts a new call."""
        calls: list[list[_Op]] = []
        run: dict[str, Optional[list[_Op]]] = {}
        for op in ops:
            cur = run.get(op.job_id)
            if cur is not None and op.kind in ("events", "final") and op.fence == cur[0].fence:
                cur.append(op)
            else:
                cur = [op]
                calls.append(cur)
            run[op.job_id] = cur if op.kind == "events" else None
        return calls

    def _queue(self, pipe, call: list[_Op]) -> None:
        op, events = call[-1], [ev for o in call for ev in o.events]
        if op.kind == "events":
            args = [self.events_maxlen, self.job_ttl_s, *events]
        elif op.kind == "final":
            args = [self.events_maxlen, self.result_ttl_s, *op.final, f"{time.time():.6f}",
                    self.worker, *events]
        else:  # release
            args = []
        fence_call(pipe, self._shas.get(FENCE_LUA), self.keys, op.job_id, op.fence.token,
                   op.kind, *args)

    def send(self, r, ops: list[_Op]) -> tuple[set[str], list[_Op]]:
        """Send `ops` (fenced writes, then the acks they earned). Returns the ids of jobs whose
        lease is gone (the fence refused their writes), and the ops Redis refused (each with its
        `refusal`), in order, to send again. Raises redis errors on connection loss."""
        fenced = [op for op in ops if op.fence is not None]
        lost: set[str] = set()
        again: list[_Op] = []
        earned = [op for op in ops if op.fence is None]
        calls = self._calls(fenced)
        for call, x in zip(calls, self._execute(r, calls, self._queue, FENCE_LUA)):
            if x == 1:
                earned += [op for op in call if op.kind == "final"]
            elif refused(x):  # it wrote nothing: send it again as it was
                for op in call:
                    op.refusal = x
                again += call
            elif isinstance(x, Exception):  # e.g. WRONGTYPE on a key a client clobbered
                log.error("job %s: %s write failed: %s", call[0].job_id, call[-1].kind, x)
            else:
                lost.add(call[0].job_id)
        if earned:
            again += self._acknowledge(r, [op for op in earned if op.entry is not None])
        return lost, again

    def _acknowledge(self, r, ops: list[_Op]) -> list[_Op]:
        """ACK_LUA for each op's entry, its dead letter first in the same script. On a cluster
        an entry of lane shard k > 0 is in another slot than the dead stream: its dead letter
        goes alone first, and only an entry whose dead letter landed is acknowledged. Returns
        what Redis refused, as ack/dead ops to send again."""
        apart = [op for op in ops if op.dead is not None and is_cluster(r)
                 and hash_tag(op.entry.stream) != hash_tag(self.keys.dead)]
        alone = {id(op) for op in apart}
        todo = [(op, op.dead) for op in ops if id(op) not in alone]
        again: list[_Op] = []
        failed: list = []
        if apart:
            def dead_letter(pipe, op):
                pipe.xadd(self.keys.dead, op.dead, maxlen=self.dead_maxlen, approximate=True)
            for op, x in zip(apart, self._execute(r, apart, dead_letter)):
                if not isinstance(x, Exception):
                    todo.append((op, None))
                elif refused(x):
                    again.append(self._ack_op(op, op.dead, x))
                else:
                    failed.append(x)
        for (op, dead), x in zip(todo, self._execute(r, todo, self._queue_ack, ACK_LUA)):
            if refused(x):
                again.append(self._ack_op(op, dead, x))
            elif isinstance(x, Exception):
                failed.append(x)
        if failed:
            log.error("%d acknowledgements failed; first: %s", len(failed), failed[0])
        return again

    def _queue_ack(self, pipe, item: tuple) -> None:
        op, dead = item
        keys = [op.entry.stream] + ([self.keys.dead] if dead is not None else [])
        args = [self.keys.group, op.entry.entry_id, self.dead_maxlen]
        for k, v in (dead or {}).items():
            args += [k, v]
        if is_cluster(pipe):  # redis-py refuses EVALSHA in cluster pipelines
            pipe.execute_command("EVAL", ACK_LUA, len(keys), *keys, *args)
        else:
            pipe.evalsha(self._shas[ACK_LUA], len(keys), *keys, *args)

    @staticmethod
    def _ack_op(op: _Op, dead: Optional[dict], refusal: Exception) -> _Op:
        """The acknowledgement still owed for `op` (its fenced write, if any, landed)."""
        return _Op("dead" if dead is not None else "ack", op.job_id, entry=op.entry, dead=dead,
                   refusal=refusal, held=op.held)

    def _execute(self, r, items: list, queue, script: Optional[str] = None) -> list:
        """One pipeline of `queue(pipe, item)` for each item; answers in order, errors as
        values, except a lost connection, which is raised. A script Redis forgot (a restart,
        SCRIPT FLUSH) is loaded and those items sent again."""
        if not items:
            return []
        if script is not None and script not in self._shas and not is_cluster(r):
            self._shas[script] = r.script_load(script)
        pipe = r.pipeline(transaction=False)
        for item in items:
            queue(pipe, item)
        res = pipe.execute(raise_on_error=False)
        retry = [i for i, x in enumerate(res) if isinstance(x, redis.exceptions.NoScriptError)]
        if retry and script is not None:
            self._shas[script] = r.script_load(script)
            pipe = r.pipeline(transaction=False)
            for i in retry:
                queue(pipe, items[i])
            for i, x in zip(retry, pipe.execute(raise_on_error=False)):
                res[i] = x
        for x in res:
            if isinstance(x, REDIS_DOWN):
                raise x
        return res

    def flush(self, r) -> set[str]:
        """Send everything now (on failure the ops stay queued for after_failure). What Redis
        refuses stays queued too, and WritesRefused is raised: the caller tries again."""
        lost, again = self.send(r, self.ops)
        self.ops = again
        if again:
            raise WritesRefused(f"{len(again)} writes refused; first: {again[0].refusal}")
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
