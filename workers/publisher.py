"""Writes each step's outbox from a background thread while the engine computes the next step.

At most one batch is in flight: the loop hands over step k's writes, runs step k+1 (torch releases
the GIL, so the Redis round trip overlaps the compute), then waits for batch k before handing over
batch k+1. A failure therefore surfaces in the loop's own thread at a known point, with the failed
ops put back in the outbox, and the usual reconnect-and-resend path takes over.
Writes Redis refused (workers/streams.py) go back to the front of the outbox the same way, to be
sent again as they were; their entries (and the leases of their jobs) are held meanwhile, so no
worker, this one included, reclaims and reruns a job whose result only waits for Redis.
"""
from __future__ import annotations

import threading
from typing import Optional

import redis

from genpool.workers.lease import LeaseKeeper
from genpool.workers.outbox import Outbox
from genpool.workers.streams import WritesRefused


class Publisher:
    def __init__(self, outbox: Outbox, r, keeper: LeaseKeeper):
        self.outbox, self.r, self.keeper = outbox, r, keeper
        self._cond = threading.Condition()
        self._batch: Optional[list] = None
        self._failed: Optional[tuple[BaseException, list]] = None
        self._refused: list = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="genpool-publisher", daemon=True)
        self._thread.start()

    @property
    def idle(self) -> bool:
        with self._cond:
            return self._batch is None and self._failed is None and not self._refused

    def submit(self, ops: list) -> None:
        """Hand over one step's writes (call wait() first: one batch at a time)."""
        if not ops:
            return
        with self._cond:
            assert self._batch is None, "submit() before the previous batch was waited for"
            self._batch = ops
            self._cond.notify_all()

    def wait(self) -> None:
        """Block until the batch in flight is written; re-raise its failure in this thread after
        putting its ops back at the front of the outbox. Refused writes go back there too, and
        raise WritesRefused (the loop waits a moment, then sends them again)."""
        with self._cond:
            while self._batch is not None:
                self._cond.wait()
            failed, self._failed = self._failed, None
            again, self._refused = self._refused, []
        if failed is not None:
            exc, ops = failed
            self.outbox.ops[:0] = ops
            raise exc
        if again:
            self.outbox.ops[:0] = again
            self._hold(again)
            raise WritesRefused(f"{len(again)} writes refused; first: {again[0].refusal}")

    def _hold(self, ops: list) -> None:
        """Keep the entries of refused terminal writes and acks fresh, and their leases renewed,
        until they land: else they would go idle and be reclaimed (a delivery counted, the job
        run again) while their result only waits for Redis to take writes again."""
        for op in ops:
            if op.entry is None:
                continue
            if op.fence is not None:
                self.keeper.grant(op.job)
            else:
                self.keeper.hold(op.entry)
            op.held = True

    def settle(self) -> None:
        """Like wait(), but a Redis failure is only noted (its ops are back in the outbox): for
        use on the way into reconnecting, before the outbox is rebuilt for resending."""
        try:
            self.wait()
        except (redis.ConnectionError, redis.TimeoutError, WritesRefused):
            pass

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(10)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._batch is None and not self._closed:
                    self._cond.wait()
                if self._batch is None:
                    return
                batch = self._batch
            failed, again = None, []
            try:
                lost, again = self.outbox.send(self.r, batch)
                for job_id in lost:  # the fence refused their writes: the lease is gone
                    self.keeper.lost(job_id)
                self._let_go(batch, again)
            except BaseException as exc:  # handed to the loop's thread, which decides
                failed = (exc, batch)
            with self._cond:
                self._batch, self._failed, self._refused = None, failed, again
                self._cond.notify_all()

    def _let_go(self, batch: list, again: list) -> None:
        """Entries held for a refused write whose resend has now landed (or was fenced out)."""
        still = {(op.entry.stream, op.entry.entry_id) for op in again if op.entry is not None}
        for op in batch:
            if op.held and (op.entry.stream, op.entry.entry_id) not in still:
                self.keeper.drop(op.entry, op.job_id)
                op.held = False
