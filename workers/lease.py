"""Job leases: a worker's right to write for a job, renewed off the engine loop, checked on every
write (fencing).

CLAIM_LUA (schemas/scripts.py) gives each attempt at a job a fresh random token, stored in the job
hash as `owner` with a `lease_until` (Redis TIME, ms). Every write a worker makes for that job
(token events, restart, result, error, release) goes through FENCE_LUA, which applies it only while
`owner` is still that token. A worker that stalled past its lease (SIGSTOP, a blocked loop, a
partition) and was replaced therefore cannot add a token or a second result: its writes come back
refused and it drops the job. Both scripts touch only the job hash and its event stream, which
share the `{<id>}` hash tag (one Redis Cluster slot). The lane-stream XACK is a separate command,
sent only after a fenced terminal write succeeded (XACK does not check who acks).

The LeaseKeeper thread renews every held lease and keeps every held lane entry's idle time fresh
(XCLAIM JUSTID), and sends the worker's heartbeat, whatever the engine loop is doing.
"""
from __future__ import annotations

import logging
import threading
import uuid
from typing import Callable, Optional

import redis

from genpool.schemas import Keys
from genpool.schemas.scripting import Script, pipelined
from genpool.schemas.scripts import FENCE_LUA
from genpool.workers.job import Entry, Fence, Job

FENCE = Script(FENCE_LUA)
__all__ = ["FENCE", "Fence", "LeaseKeeper", "fence_call", "lease_outcomes", "new_token"]

log = logging.getLogger("genpool.worker")


def new_token(worker: str, nonce: Optional[str] = None) -> str:
    """A fencing token unique to one attempt by one worker (never reused, even after a Redis
    rollback that forgets an attempt counter)."""
    return f"{worker}/{nonce or uuid.uuid4().hex[:16]}"


def fence_call(pipe, keys: Keys, job_id: str, token: str, op: str, *args) -> None:
    """Queue FENCE_LUA on one job's two keys (one slot: their `{id}` hash tag)."""
    FENCE.queue(pipe, [keys.job(job_id), keys.events(job_id)], [token, op, *args])


class LeaseKeeper:
    """Background thread: renews leases, refreshes held entries' idle time, beats the heartbeat.

    The loop registers what it holds (`hold` an entry as soon as it is read, `grant` a lease once
    CLAIM_LUA gave a token, `drop` when done); leases found lost are queued for the loop to
    collect with `take_lost()` (it aborts those jobs without writing anything)."""

    def __init__(self, r, keys: Keys, worker: str, lease_ms: int, interval_s: float,
                 beat: Callable[[], None]):
        self.r, self.keys, self.worker = r, keys, worker
        self.lease_ms, self.interval_s, self._beat = lease_ms, interval_s, beat
        self._lock = threading.Lock()
        # held while the entries' idle times are refreshed, so a hand-off (let_go) never races
        # a refresh that would XCLAIM the entry back from the peer it was just given to
        self._refresh_lock = threading.Lock()
        self._entries: dict[tuple[str, str], Entry] = {}
        self._leases: dict[str, Job] = {}  # job id -> the job whose fence holds the lease
        self._lost: list[str] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # -- what the loop holds ------------------------------------------------------------------
    def hold(self, entry: Entry) -> None:
        with self._lock:
            self._entries[(entry.stream, entry.entry_id)] = entry

    def grant(self, job: Job) -> None:
        """Renew this job's lease (job.fence) until it is dropped."""
        with self._lock:
            self._leases[job.job_id] = job
            self._entries[(job.entry.stream, job.entry.entry_id)] = job.entry

    def drop(self, entry: Entry, job_id: Optional[str] = None) -> None:
        with self._lock:
            self._entries.pop((entry.stream, entry.entry_id), None)
            if job_id is not None:
                lease = self._leases.get(job_id)
                if lease is not None and lease.entry is entry:
                    del self._leases[job_id]

    def let_go(self, entries: list, then: Callable[[], None]) -> None:
        """Stop holding these entries (no lease taken on them yet) and run `then` (the hand-off
        XCLAIM to a peer) with no refresh in between that could claim them back."""
        with self._refresh_lock:
            with self._lock:
                for e in entries:
                    self._entries.pop((e.stream, e.entry_id), None)
            then()

    def call(self, job_id: str, token: str, op: str, *args):
        """One fenced call now (not pipelined): 1 when it landed, 0 when the lease is gone."""
        return FENCE(self.r, [self.keys.job(job_id), self.keys.events(job_id)], [token, op, *args])

    def holds(self, entry: Entry) -> bool:
        with self._lock:
            return (entry.stream, entry.entry_id) in self._entries

    def lost(self, job_id: str) -> None:
        with self._lock:
            self._lost.append(job_id)

    def take_lost(self) -> list[str]:
        with self._lock:
            out, self._lost = self._lost, []
            return out

    # -- the thread ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="genpool-leases", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for what, fn in (("lease renewal", self.renew), ("heartbeat", self._beat)):
                try:  # each on its own: a renewal that failed must not also stop the heartbeat
                    fn()
                except redis.RedisError as e:  # the loop reconnects; we simply try again
                    log.warning("%s failed (%s); retrying in %.1f s", what, e, self.interval_s)
                except Exception:  # noqa: BLE001 - this thread must outlive any single failure
                    log.exception("%s failed", what)

    def renew(self) -> None:
        """One round trip renewing every lease, then one refreshing the entries still ours. A
        renewal answered with an error (not the script's 0) is neither renewed nor lost: the
        refresh still runs, and the error is raised after it (the next round tries again)."""
        with self._lock:
            leases = list(self._leases.values())
            entries = dict(self._entries)
        error = None
        if leases:
            answers = pipelined(self.r, leases, self._queue_renew, [FENCE])
            for lease, raw, held in zip(leases, answers, lease_outcomes(answers)):
                if held is None:
                    error = error or RenewalError(f"job {lease.job_id}: {raw}")
                elif not held:
                    log.warning("job %s: lease lost (another worker took it over)", lease.job_id)
                    entries.pop((lease.entry.stream, lease.entry.entry_id), None)
                    self.lost(lease.job_id)
        with self._refresh_lock:
            with self._lock:  # only what is still held now (a hand-off may have let some go)
                entries = {k: e for k, e in entries.items() if k in self._entries}
            by_stream: dict[str, list[str]] = {}
            for e in entries.values():
                by_stream.setdefault(e.stream, []).append(e.entry_id)
            if by_stream:  # JUSTID: resets the idle time without counting a delivery
                pipe = self.r.pipeline(transaction=False)
                for stream, ids in by_stream.items():
                    pipe.xclaim(stream, self.keys.group, self.worker, 0, ids, justid=True)
                pipe.execute(raise_on_error=False)
        if error is not None:
            raise error

    def _queue_renew(self, pipe, job: Job) -> None:
        fence_call(pipe, self.keys, job.job_id, job.fence.token, "renew", self.lease_ms)


class RenewalError(redis.RedisError):
    """Some renewals were answered with an error (logged, retried next round)."""


def lease_outcomes(res: list) -> list:
    """Per renewal: True renewed, False lost (the fence script's own 0: another worker took the
    job over), None unknown (an error in place of an answer: a cluster shard that is down or
    resharding, a clobbered key), which says nothing about the lease and is tried again."""
    return [None if isinstance(x, Exception) else x == 1 for x in res]
