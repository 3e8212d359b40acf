"""How a worker recovers: it takes over the jobs of dead peers, and rides out a lost Redis.

A mixin of Worker (workers/worker.py), kept apart so the loop reads top to bottom; it uses the
worker's Redis client, keys, config, inflight map, publisher, outbox and counters.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import redis

from genpool.schemas.connection import REDIS_DOWN, backoff
from genpool.workers.streams import ensure_groups, publish_shards, reclaim, refused

log = logging.getLogger("genpool.worker")

REFUSED_RETRY_S = 0.2  # how long the loop waits after Redis refused writes, before trying again
REFUSED_LOG_S = 10.0  # at most one warning this often while the refusals go on


class Recovery:
    def _init_recovery(self) -> None:
        self.next_upkeep = 0.0
        self.reclaim_owed = False  # a reclaim check found no free slot (see upkeep)
        self._refusal_said = -REFUSED_LOG_S  # when refused writes were last warned about

    def upkeep(self) -> None:
        """Take over the jobs of dead peers (idle past claim_idle_ms). A check that finds no
        free slot stays owed and runs at the next step that frees one, before the lanes refill
        it: those jobs have waited longest, so the backlog must not starve them."""
        now = time.monotonic()
        if now < self.next_upkeep and not self.reclaim_owed:
            return
        if now >= self.next_upkeep:
            self.next_upkeep = now + min(self.cfg.heartbeat_s, self.cfg.claim_idle_ms / 3000)
        free = 0 if self.stopping else self.capacity(backlog=False)  # before peers' hand-offs
        self.reclaim_owed = free <= 0 and not self.stopping
        if free <= 0:
            return
        self.publisher.wait()  # acks in flight must land first, or we would reclaim our own
        claimed = reclaim(self.r, self.keys, self.name, self.cfg.claim_idle_ms, free)
        self.reclaim_owed = len(claimed) >= free  # the slots ran out first: more may wait
        self.admit(claimed)

    def _guarded(self, fn, attempts: Optional[int] = None) -> bool:
        """Run a stage; on Redis loss, reconnect with backoff and keep every job (nothing acked
        is lost: acks only ever travel with their results). True when the stage completed."""
        try:
            fn()
            return True
        except REDIS_DOWN as e:
            log.warning("Redis connection lost (%s); reconnecting", e)
            self.publisher.settle()  # its failed ops return to the outbox first
            # the last writes may or may not have landed: whatever is sent next (after a
            # reconnect, or by a draining worker's last flush) resends as restart + replay
            self.outbox.after_failure(list(self.inflight.values()))
            self._reconnect(attempts)
        except redis.ResponseError as e:
            if refused(e):
                self._writes_refused(e)
            elif "NOGROUP" in str(e) or "UNBLOCKED" in str(e):
                log.warning("lane streams or groups vanished (%s); recreating", e)
                self._guarded(lambda: ensure_groups(self.r, self.keys))
            else:  # e.g. a key of the wrong type: keep serving, but loudly and not in a hot loop
                log.error("Redis refused a command: %s", e)
                self._stop_event.wait(1.0)
        return False

    def _writes_refused(self, e: redis.ResponseError, pause: bool = True) -> None:
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
        if self.stopping:  # the stop event is set for good now: it would not wait at all
            time.sleep(REFUSED_RETRY_S)
        else:
            self._stop_event.wait(REFUSED_RETRY_S)

    def _reconnect(self, attempts: Optional[int]) -> None:
        delays = backoff(0.1, 5.0)
        tries = 0
        while attempts is None or tries < attempts:
            tries += 1
            if self.stopping and (not self.inflight or time.monotonic() >= self.drain_deadline):
                return  # nothing left worth waiting for Redis
            try:
                self.r.ping()
                self.keys = publish_shards(self.r, self.keys)  # a failover may have lost it
                ensure_groups(self.r, self.keys)
                self.counts["reconnects"] += 1
                log.info("reconnected to Redis")
                return
            except REDIS_DOWN:
                self._stop_event.wait(next(delays))
