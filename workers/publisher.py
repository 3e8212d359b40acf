"""Writes each step's outbox from a background thread while the engine computes the next step.

At most one batch is in flight: the loop hands over step k's writes, runs step k+1 (torch releases
the GIL, so the Redis round trip overlaps the compute), then waits for batch k before handing over
batch k+1. A failure therefore surfaces in the loop's own thread at a known point, with the failed
ops put back in the outbox, and the usual reconnect-and-resend path takes over.
"""
from __future__ import annotations

import threading
from typing import Callable, Optional

import redis

from genpool.workers.outbox import Outbox


class Publisher:
    def __init__(self, outbox: Outbox, r, on_lost: Callable[[str], None] = lambda job_id: None):
        self.outbox, self.r, self.on_lost = outbox, r, on_lost
        self._cond = threading.Condition()
        self._batch: Optional[list] = None
        self._failed: Optional[tuple[BaseException, list]] = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="genpool-publisher", daemon=True)
        self._thread.start()

    @property
    def idle(self) -> bool:
        with self._cond:
            return self._batch is None and self._failed is None

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
        putting its ops back at the front of the outbox."""
        with self._cond:
            while self._batch is not None:
                self._cond.wait()
            failed, self._failed = self._failed, None
        if failed is not None:
            exc, ops = failed
            self.outbox.ops[:0] = ops
            raise exc

    def settle(self) -> None:
        """Like wait(), but a Redis failure is only noted (its ops are back in the outbox): for
        use on the way into reconnecting, before the outbox is rebuilt for resending."""
        try:
            self.wait()
        except (redis.ConnectionError, redis.TimeoutError):
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
            failed = None
            try:
                for job_id in self.outbox.send(self.r, batch):  # writes refused: lease gone
                    self.on_lost(job_id)
            except BaseException as exc:  # handed to the loop's thread, which decides
                failed = (exc, batch)
            with self._cond:
                self._batch, self._failed = None, failed
                self._cond.notify_all()
