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

from genpool.schemas import ErrorEvent, Keys, RestartEvent, ResultEvent, ResumeEvent, TokenEvent
from genpool.schemas.connection import is_cluster
from genpool.schemas.keys import (
    DEAD_MAXLEN,
    EVENTS_MAXLEN,
    FINISHED_STATES,
    JOB_TTL_S,
    RELEASED_IDLE_MS,
    RESULT_TTL_S,
    field_text,
    hash_tag,
)
from genpool.schemas.scripting import Script, pipelined
from genpool.schemas.scripts import ACK_LUA
from genpool.workers.job import Entry, Fence, Job
from genpool.workers.lease import FENCE, fence_call
from genpool.workers.observe import Observers
from genpool.workers.streams import WritesRefused, refused
from genpool.workers.usage import UsageCount, count_after, queue_final, settle_after

log = logging.getLogger("genpool.worker")

# Job hash `state` for each error code; readers rely on these names (docs/protocol.md).
ERROR_STATES = {"cancelled": "cancelled", "expired": "expired", "dead_lettered": "dead"}


ACK = Script(ACK_LUA)


@dataclass
class Write:
    """One write for one job (every entry a worker holds is a Job, workers/job.py)."""
    kind: str  # events | final | release | ack | dead
    job: Job
    fenced: bool = True  # carries the job's fence (an ack, or an unfenced dead letter, does not)
    events: list[str] = field(default_factory=list)  # event JSONs
    final: tuple = ()  # (state, field) of a terminal write
    ends: bool = False  # its entry is acknowledged once it (if fenced) landed
    dead: Optional[dict] = None  # dead-letter fields, added with the ack
    refusal: Optional[Exception] = None  # Redis refused it (last time it was sent)
    held: bool = False  # queued again after a refusal, its entry (and lease) held meanwhile
    usage: Optional[UsageCount] = None  # a result's tokens, counted with it (workers/usage.py)

    @property
    def job_id(self) -> Optional[str]:
        return self.job.job_id

    @property
    def fence(self) -> Optional[Fence]:
        return self.job.fence if self.fenced else None

    @property
    def entry(self) -> Optional[Entry]:
        return self.job.entry if self.ends else None


class Outbox:
    def __init__(self, keys: Keys, worker: str, events_maxlen: int = EVENTS_MAXLEN,
                 result_ttl_s: int = RESULT_TTL_S, job_ttl_s: int = JOB_TTL_S,
                 dead_maxlen: int = DEAD_MAXLEN):
        self.keys, self.worker = keys, worker
        self.events_maxlen, self.dead_maxlen = events_maxlen, dead_maxlen
        self.result_ttl_s, self.job_ttl_s = result_ttl_s, job_ttl_s
        self.ops: list[Write] = []
        # told of every job's end: result() and error() run once per job, resends never do
        self.observers = Observers()

    def __len__(self) -> int:
        return len(self.ops)

    # -- events --------------------------------------------------------------------------
    def _event_json(self, ev, fence: Fence) -> str:
        if ev.type not in ("restart", "resume"):
            ev.attempt = fence.attempt
        return ev.model_dump_json(exclude_none=True)

    def token(self, job: Job, ev: TokenEvent) -> None:
        self.ops.append(Write("events", job, events=[self._event_json(ev, job.fence)]))

    def restart(self, job: Job, reason: str) -> None:
        ev = RestartEvent(reason=reason, attempt=job.fence.attempt)
        self.ops.append(Write("events", job, events=[self._event_json(ev, job.fence)]))

    def resume(self, job: Job, tokens: list[int]) -> None:
        ev = ResumeEvent(attempt=job.fence.attempt, tokens=tokens)
        self.ops.append(Write("events", job, events=[self._event_json(ev, job.fence)]))

    def release(self, job: Job) -> None:
        """Hand an unfinished job back (drain timeout): the next worker reruns it uncharged."""
        self.ops.append(Write("release", job))

    # -- terminal writes (each one acknowledged after it landed) --------------------------
    def result(self, job: Job, ev: ResultEvent) -> None:
        self.observers.emit("job_finished", job, ev)
        self.ops.append(Write("final", job, events=[self._event_json(ev, job.fence)],
                              final=("done", "result"), ends=True, usage=UsageCount.of(job, ev)))

    def error(self, job: Job, ev: ErrorEvent, dead: Optional[dict] = None) -> None:
        state = ERROR_STATES.get(ev.code, "error")
        self.observers.emit("job_failed", job.job_id, ev, job)
        self.ops.append(Write("final", job, events=[self._event_json(ev, job.fence)],
                              final=(state, "error"), ends=True, dead=dead))

    def ack(self, job: Job) -> None:
        """Acknowledge an entry nobody owns a lease on (a duplicate id, a finished job)."""
        self.ops.append(Write("ack", job, fenced=False, ends=True))

    def dead(self, job: Job, reason: str, tell_reader: bool = True) -> None:
        """Move an entry to the dead-letter stream; tell its reader when there is one (a job
        id, a lease, and `tell_reader`)."""
        entry = job.entry
        fields = {"reason": reason[:2000], "stream": entry.stream, "source_entry": entry.entry_id,
                  "deliveries": entry.deliveries, "payload": entry.dead_payload(),
                  "worker": self.worker, "at": f"{time.time():.6f}"}
        if tell_reader and job.job_id and job.fence is not None:
            fields["job_id"] = job.job_id
            self.error(job, ErrorEvent(code="dead_lettered", message=reason), dead=fields)
        else:
            self.ops.append(Write("dead", job, fenced=False, ends=True, dead=fields))

    def _unwritable(self, r, ops: list[Write], x: Exception) -> list[Write]:
        """For terminal writes refused WRONGTYPE: an acknowledgement where the job's state says
        its end landed (the script failed after it: a shared key, e.g. the usage bucket, of
        another type), else the entry's dead letter (its own keys were given another type)."""
        states = pipelined(r, ops, lambda pipe, op: pipe.hget(self.keys.job(op.job_id), "state"))
        out = []
        for op, state in zip(ops, states):
            if not isinstance(state, Exception) and field_text(state) in FINISHED_STATES:
                out.append(Write("ack", op.job, fenced=False, ends=True))
                continue
            e = op.job.entry
            why = f"its result cannot be written to its keys ({str(x)[:300]}): dead-lettered"
            out.append(Write("dead", op.job, fenced=False, ends=True, dead={
                "reason": why, "stream": e.stream, "source_entry": e.entry_id,
                "deliveries": e.deliveries, "payload": e.dead_payload(), "worker": self.worker,
                "at": f"{time.time():.6f}", "job_id": op.job_id or ""}))
        return out

    def discard(self, job_id: str) -> None:
        """Forget every queued write for a job this worker no longer holds (they would be
        refused by the fence anyway; not sending them saves the round trip)."""
        self.ops = [op for op in self.ops if op.job_id != job_id]

    # -- sending -------------------------------------------------------------------------
    def take(self) -> list[Write]:
        ops, self.ops = self.ops, []
        return ops

    @staticmethod
    def _calls(ops: list[Write]) -> list[list[Write]]:
        """The fenced calls for `ops`: a job's events, and the final write after them, go in
        one call, so Redis applies or refuses them together (a result can never land when a
        token before it was refused). A release, or another attempt's op, starts a new call."""
        calls: list[list[Write]] = []
        run: dict[str, Optional[list[Write]]] = {}
        for op in ops:
            cur = run.get(op.job_id)
            if cur is not None and op.kind in ("events", "final") and op.fence == cur[0].fence:
                cur.append(op)
            else:
                cur = [op]
                calls.append(cur)
            run[op.job_id] = cur if op.kind == "events" else None
        return calls

    def _queue(self, pipe, call: list[Write]) -> None:
        op, events = call[-1], [ev for o in call for ev in o.events]
        if op.kind == "events":
            args = [self.events_maxlen, self.job_ttl_s, *events]
        elif op.kind == "final":
            args = [self.events_maxlen, self.result_ttl_s, *op.final, f"{time.time():.6f}",
                    self.worker]
            if op.usage is not None and not is_cluster(pipe):
                return queue_final(pipe, self.keys, op.job_id, op.fence.token, args, events,
                                   op.usage)
            args += events
        else:  # release
            args = []
        fence_call(pipe, self.keys, op.job_id, op.fence.token, op.kind, *args)

    def send(self, r, ops: list[Write]) -> tuple[set[str], list[Write]]:
        """Send `ops` (fenced writes, then the acks they earned). Returns the ids of jobs whose
        lease is gone (the fence refused their writes), and the ops Redis refused (each with its
        `refusal`), in order, to send again. Raises redis errors on connection loss."""
        fenced = [op for op in ops if op.fence is not None]
        lost: set[str] = set()
        again: list[Write] = []
        earned = [op for op in ops if op.fence is None]
        calls = self._calls(fenced)
        released = []
        for call, x in zip(calls, pipelined(r, calls, self._queue, [FENCE])):
            if x == 1:
                earned += [op for op in call if op.kind == "final"]
                released += [op for op in call if op.kind == "release"]
            elif refused(x):  # it wrote nothing: send it again as it was
                for op in call:
                    op.refusal = x
                again += call
            elif isinstance(x, Exception):  # e.g. WRONGTYPE on a key a client clobbered
                log.error("job %s: %s write failed: %s", call[0].job_id, call[-1].kind, x)
                if "WRONGTYPE" in str(x):  # its keys will never take it: dead-letter the entry
                    # now, or the job reruns after every lease expiry, unanswered, for ever
                    earned += self._unwritable(r, [op for op in call if op.kind == "final"
                                                   and op.job.entry is not None], x)
            else:
                lost.add(call[0].job_id)
        counts = [op.usage for op in earned if op.kind == "final" and op.usage is not None]
        if counts and is_cluster(r):
            count_after(r, self.keys, counts)
        if earned:
            again += self._acknowledge(r, [op for op in earned if op.entry is not None])
        if released:
            self._hand_over(r, released)
        if counts:  # fair pull's turns: what each result really used (workers/usage.py)
            settle_after(r, self.keys, counts)
        return lost, again

    def _hand_over(self, r, ops: list[Write]) -> None:
        """Make released entries look long idle (still ours, no delivery charged), so that a
        peer's next reclaim check takes them at once (a drain hands over in seconds, not after
        claim_idle_ms). If this fails they are reclaimed after claim_idle_ms as before."""
        def idle(pipe, op):
            e = op.job.entry
            pipe.xclaim(e.stream, self.keys.group, self.worker, 0, [e.entry_id],
                        idle=RELEASED_IDLE_MS, justid=True)
        failed = [x for x in pipelined(r, ops, idle) if isinstance(x, Exception)]
        if failed:
            log.warning("%d released entries wait for the claim window: %s", len(failed),
                        failed[0])

    def _acknowledge(self, r, ops: list[Write]) -> list[Write]:
        """ACK_LUA for each op's entry, its dead letter first in the same script. On a cluster
        an entry of lane shard k > 0 is in another slot than the dead stream: its dead letter
        goes alone first, and only an entry whose dead letter landed is acknowledged. Returns
        what Redis refused, as ack/dead ops to send again."""
        apart = [op for op in ops if op.dead is not None and is_cluster(r)
                 and hash_tag(op.entry.stream) != hash_tag(self.keys.dead)]
        alone = {id(op) for op in apart}
        todo = [(op, op.dead) for op in ops if id(op) not in alone]
        again: list[Write] = []
        failed: list = []
        if apart:
            def dead_letter(pipe, op):
                pipe.xadd(self.keys.dead, op.dead, maxlen=self.dead_maxlen, approximate=True)
            for op, x in zip(apart, pipelined(r, apart, dead_letter)):
                if not isinstance(x, Exception):
                    todo.append((op, None))
                elif refused(x):
                    again.append(self._ack_op(op, op.dead, x))
                else:
                    failed.append(x)
        for (op, dead), x in zip(todo, pipelined(r, todo, self._queue_ack, [ACK])):
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
        ACK.queue(pipe, keys, args)

    @staticmethod
    def _ack_op(op: Write, dead: Optional[dict], refusal: Exception) -> Write:
        """The acknowledgement still owed for `op` (its fenced write, if any, landed)."""
        return Write("dead" if dead is not None else "ack", op.job, fenced=False, ends=True,
                     dead=dead, refusal=refusal, held=op.held)

    def flush(self, r) -> set[str]:
        """Send everything now (on failure the ops stay queued for after_failure). What Redis
        refuses stays queued too, and WritesRefused is raised: the caller tries again."""
        lost, again = self.send(r, self.ops)
        self.ops = again
        if again:
            raise WritesRefused(f"{len(again)} writes refused; first: {again[0].refusal}")
        return lost

    def after_failure(self, live: list[Job]) -> None:
        """The last flush may or may not have landed: make a resend idempotent for readers."""
        keep = [op for op in self.ops if op.kind != "events"]
        self.ops = []
        jobs = {j.id: j for j in live}
        # jobs that ran (the engine knew them) and ended in the lost batch: their tokens too
        jobs.update({op.job.id: op.job for op in keep if op.kind == "final" and op.job.engine_id})
        for job in jobs.values():
            self.restart(job, "worker lost its Redis connection; resending")
            for ev in job.replay_events():
                self.token(job, ev)
        self.ops += keep
