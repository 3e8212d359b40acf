"""How a worker rides out a lost Redis and writes Redis refuses, keeping every job.

`Recovery.guarded(stage)` runs one stage of the loop (workers/worker.py). On a lost connection it
settles the publisher, makes the outbox's resend idempotent for readers (restart + replay), and
reconnects with backoff; on refused writes (memory pressure, too few replicas) it waits a moment;
nothing acked is ever lost, since acks only travel with their results.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

import redis

from genpool.schemas.connection import REDIS_DOWN, backoff
from genpool.workers.jobs import JobTable
from genpool.workers.outbox import Outbox
from genpool.workers.publisher import Publisher
from genpool.workers.streams import refused

log = logging.getLogger("genpool.worker")

REFUSED_RETRY_S = 0.2  # how long the loop waits after Redis refused writes, before trying again
REFUSED_LOG_S = 10.0  # at most one warning this often while the refusals go on


class Recovery:
    def __init__(self, r, publisher: Publisher, outbox: Outbox, jobs: JobTable, counts: dict,
                 stop_event: threading.Event, refresh_lanes: Callable[[], None],
                 give_up: Callable[[], bool], stopping: Callable[[], bool]):
        self.r, self.publisher, self.outbox, self.jobs = r, publisher, outbox, jobs
        self.counts, self._stop_event = counts, stop_event
        # refresh_lanes: the lane shards and groups after a reconnect (a failover may have lost
        # them); give_up: a draining worker with nothing left worth waiting for Redis
        self._refresh_lanes, self._give_up, self._stopping = refresh_lanes, give_up, stopping
        self._refusal_said = -REFUSED_LOG_S  # when refused writes were last warned about

    def guarded(self, fn, attempts: Optional[int] = None) -> bool:
        """Run a stage; on Redis loss, reconnect with backoff and keep every job. True when the
        stage completed."""
        try:
            fn()
            return True
        except REDIS_DOWN as e:
            log.warning("Redis connection lost (%s); reconnecting", e)
            self.publisher.settle()  # its failed ops return to the outbox first
            # the last writes may or may not have landed: whatever is sent next (after a
            # reconnect, or by a draining worker's last flush) resends as restart + replay
            self.outbox.after_failure(list(self.jobs))
            self._reconnect(attempts)
        except redis.ResponseError as e:
            if refused(e):
                self.writes_refused(e)
            elif "NOGROUP" in str(e) or "UNBLOCKED" in str(e):
                log.warning("lane streams or groups vanished (%s); recreating", e)
                self.guarded(self._refresh_lanes)
            else:  # e.g. a key of the wrong type: keep serving, but loudly and not in a hot loop
                log.error("Redis refused a command: %s", e)
                self._stop_event.wait(1.0)
        return False

    def writes_refused(self, e: redis.ResponseError, pause: bool = True) -> None:
        """Redis is up but takes no writes (memory pressure, too few replicas, a replica): like
        a lost connection, every job and entry is kept, and what was refused (queued again in
        the outbox, or held for a new claim) is sent again after a short wait (`pause`)."""
        self.counts["refused"] = self.counts.get("refused", 0) + 1
        now = time.monotonic()
        if now - self._refusal_said >= REFUSED_LOG_S:
            self._refusal_said = now
            log.warning("Redis refuses writes (%s); keeping every job, trying again every %.1f s "
                        "(%d refusals so far)", e, REFUSED_RETRY_S, self.counts["refused"])
        if not pause:
            return
        if self._stopping():  # the stop event is set for good now: it would not wait at all
            time.sleep(REFUSED_RETRY_S)
        else:
            self._stop_event.wait(REFUSED_RETRY_S)

    def _reconnect(self, attempts: Optional[int]) -> None:
        delays = backoff(0.1, 5.0)
        tries = 0
        while attempts is None or tries < attempts:
            tries += 1
            if self._give_up():
                return  # nothing left worth waiting for Redis
            try:
                self.r.ping()
                self._refresh_lanes()
                self.counts["reconnects"] += 1
                log.info("reconnected to Redis")
                return
            except REDIS_DOWN:
                self._stop_event.wait(next(delays))
            except redis.ResponseError as e:  # up, but refusing the lanes' writes (OOM under
                # noeviction, a demoted master's READONLY): wait it out like a lost connection
                if refused(e):
                    self.writes_refused(e, pause=False)
                else:
                    log.error("Redis refused a command while reconnecting: %s", e)
                self._stop_event.wait(next(delays))
