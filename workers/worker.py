"""The resident worker: Redis lane streams -> one engine -> per-job Redis event streams.

Read `Worker.run` and `Worker.tick` top to bottom; each line is one stage of a step. The worker
composes its parts: `LaneReads` (workers/lane_reads.py) fetches entries, `Admission`
(workers/admit.py) turns them into jobs, `JobTable` (workers/jobs.py) holds them and ends each
one, the `OutputCollector` (workers/collect.py) turns engine outputs into events, the `Outbox`
and `Publisher` write, the `LeaseKeeper` renews, the `Router` routes by prefix (its `Inbox`
takes peers' hand-offs), `Recovery` rides out a lost Redis. Every Redis key comes from
genpool.schemas.keys; docs/protocol.md describes the wire format.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections import deque
from typing import Optional

import redis

from genpool.engine.protocol import Engine
from genpool.schemas import LANES, Keys
from genpool.schemas.workers import WorkerInfo
from genpool.workers.admission import Admitter
from genpool.workers.admit import Admission
from genpool.workers.caps import ConcurrencyCaps
from genpool.workers.collect import OutputCollector
from genpool.workers.fair import FairPull
from genpool.workers.heartbeat import Heartbeat
from genpool.workers.job import Entry
from genpool.workers.jobs import JobTable
from genpool.workers.lane_reads import LaneReads
from genpool.workers.lease import LeaseKeeper
from genpool.workers.observe import Observers
from genpool.workers.outbox import Outbox
from genpool.workers.publisher import Publisher
from genpool.workers.recovery import Recovery
from genpool.workers.router import Router
from genpool.workers.streams import (
    ControlReader,
    ensure_groups,
    entries_from,
    own_pending,
    publish_shards,
    reclaim,
)
from genpool.workers.worker_config import WorkerConfig

log = logging.getLogger("genpool.worker")


class Worker:
    def __init__(self, engine: Engine, r: redis.Redis, keys: Keys, cfg: WorkerConfig):
        self.engine, self.r, self.keys, self.cfg, self.name = engine, r, keys, cfg, cfg.name
        self.counts = {"done": 0, "failed": 0, "reconnects": 0, "lost": 0}
        # busy loop time vs time inside engine.step(): the queue's overhead, shown in heartbeats;
        # stall_max_s: the longest time a tick kept a busy engine from stepping
        self.timing = {"busy_s": 0.0, "engine_s": 0.0, "stall_max_s": 0.0}
        self.steps, self.started = 0, False
        self.step_ends: deque[float] = deque(maxlen=256)  # wall-clock end of recent steps
        self.stopping, self.drain_deadline = False, float("inf")
        self._stop_event = threading.Event()
        st = engine.stats()
        self.max_seqs = cfg.max_inflight or (st.free_seq_slots + st.num_running + st.num_waiting)
        self.kv_total, self.block_size = st.kv_blocks_total, st.block_size
        self.observers = Observers()  # metrics / Flower events (workers/observe.py)
        self.outbox = Outbox(keys, self.name, cfg.events_maxlen, cfg.result_ttl_s, cfg.job_ttl_s)
        self.outbox.observers = self.observers  # the outbox reports every job's end
        self.heartbeat = Heartbeat(r, keys, self.name, cfg.heartbeat_s)
        # leases are renewed (and the heartbeat sent) by a thread of their own: a slow step or
        # a blocked loop never lets another worker take over a live job (workers/lease.py)
        self.keeper = LeaseKeeper(r, keys, self.name, cfg.claim_idle_ms,
                                  min(cfg.heartbeat_s, cfg.claim_idle_ms / 3000), self._beat)
        self.publisher = Publisher(self.outbox, r, self.keeper)
        # tenants' concurrency slots: taken at claim time, renewed by the lease thread
        self.caps = ConcurrencyCaps(r, keys, cfg.claim_idle_ms, self.name)
        self.jobs = JobTable(engine, self.outbox, self.keeper, r, keys, self.name,
                             self.observers, self.counts, self.caps.release)
        self.collector = OutputCollector(self.jobs, self.outbox, self.observers, self.step_ends)
        self.router = Router(self, engine, r, cfg, self.keeper)  # prefix-aware routing
        self.fair = FairPull(self.name)  # tenants' sub-streams, weights (workers/fair.py)
        self.recovery = Recovery(r, self.publisher, self.outbox, self.jobs, self.counts,
                                 self._stop_event, self._refresh_lanes, self._give_up,
                                 lambda: self.stopping)
        self.admission = Admission(engine, cfg.served_models, Admitter(
            r, keys, self.name, cfg.max_deliveries, cfg.job_ttl_s, cfg.claim_idle_ms, cfg.resume),
            self.jobs, self.keeper, self.router, self.observers, self.recovery.writes_refused,
            self.caps)
        self.control = ControlReader(keys)
        self.lanes = LaneReads(r, self.name, cfg.idle_block_ms, self.control, self.fair,
                               self.caps, self.router.inbox)  # workers/lane_reads.py
        self.next_upkeep, self.reclaim_owed = 0.0, False  # see upkeep

    @property
    def model_name(self) -> str:
        """One name for this worker's model (aliases are the other served names)."""
        return self.cfg.model_name or min(self.cfg.served_models, default="unknown")

    # -- the loop ------------------------------------------------------------------------
    def run(self) -> int:
        self._install_signals()
        guarded = self.recovery.guarded
        while not self.started and not self._done():
            guarded(self.start)
        self.keeper.start()
        while not self._done():
            t0, e0 = time.perf_counter(), self.timing["engine_s"]
            busy = bool(self.jobs) or self.engine.has_unfinished_requests()
            guarded(self.tick)
            if busy or self.jobs:
                dt = time.perf_counter() - t0
                self.timing["busy_s"] += dt
                stall = dt - (self.timing["engine_s"] - e0)
                self.timing["stall_max_s"] = max(self.timing["stall_max_s"], stall)
        self.jobs.release_all()  # past the drain deadline: rerun elsewhere, uncharged
        guarded(self.router.leave, attempts=3)  # its backlog goes to a peer
        self.keeper.stop()
        for _ in range(3):
            if guarded(self.finish, attempts=3):
                break
        guarded(self.caps.flush, attempts=3)  # the slots of the jobs that ended last
        self.publisher.close()
        self.admission.close()
        self.observers.emit("worker_stopped", self)
        log.info("worker %s stopped: %s", self.name, self.counts)
        return 0

    def start(self) -> None:
        self._refresh_lanes()
        self.control.start_at_tail(self.r)
        self.fair.refresh(self.r, self.keys)
        self.admission.admit(own_pending(self.r, self.keys, self.name, self.max_seqs,
                                         self.fair.sub_streams))
        self.heartbeat.beat(self.status())
        self.started = True
        self.observers.emit("worker_started", self)
        log.info("worker %s ready (prefix %s, %d slots, models %s)", self.name, self.keys.prefix,
                 self.max_seqs, sorted(self.cfg.served_models))

    def tick(self) -> None:
        self.upkeep()  # take over dead workers' entries
        self.router.publish_if_due()  # our cached prefix blocks and load, for peers' routing
        self.jobs.drop_lost(self.keeper.take_lost())  # leases another worker took: write nothing
        self.admission.run_solo(self._flush)  # a suspect job starts once the engine is empty
        cancels, entries = self.poll()  # one round trip while full: control + high lane
        self.jobs.cancel(cancels)  # aborts within this step, frees the KV blocks
        handed = [] if self.stopping or self.jobs.solo_busy else self.router.inbox.take(
            self.capacity(backlog=False) - len(entries), self.cfg.high_burst)  # peers' hand-offs
        self.admission.admit(entries + handed)  # validate, route, claim, engine.add_request
        self.jobs.expire()  # deadlines passed while running
        self.step_and_publish()  # one engine step, then ONE MULTI with every write of the step
        self.observers.emit("tick", self)  # metrics snapshot, Flower heartbeat

    def _done(self) -> bool:
        if not self.stopping:
            return False
        idle = (not self.jobs and not len(self.outbox) and self.publisher.idle
                and not self.jobs.solo)
        return idle or time.monotonic() >= self.drain_deadline

    # -- stages --------------------------------------------------------------------------
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
        self.fair.refresh(self.r, self.keys)
        claimed = reclaim(self.r, self.keys, self.name, self.cfg.claim_idle_ms, free,
                          self.fair.sub_streams)
        self.reclaim_owed = len(claimed) >= free  # the slots ran out first: more may wait
        self.admission.admit(claimed)

    def capacity(self, backlog: bool = True) -> int:
        """How many more jobs fit: sequence slots, and KV blocks for their worst case. None
        while a suspect job waits to run, or runs, alone. Jobs peers handed us count as taken
        (`backlog`), so a worker with a hand-off backlog pulls no new entries."""
        free = self.jobs.free(self.max_seqs, self.kv_total, self.block_size)
        return max(0, free - self.admission.pending - (self.router.waiting if backlog else 0))

    def jobs_taken(self) -> int:
        return self.counts["done"] + self.counts["failed"] + len(self.jobs)

    def poll(self) -> tuple[list[str], list[Entry]]:
        """Cancels from the control stream, and new entries sized to what the engine can hold.
        The high lane is read every step, even when full, so interactive work can preempt."""
        free = 0 if self.stopping else self.capacity()
        entries: list[Entry] = []
        idle = not (self.jobs or self.engine.has_unfinished_requests() or len(self.outbox))
        if idle and free > 0:  # nothing to step: wait for work (bounded, so upkeep still runs)
            entries = self.lanes.blocking_read(self.keys, free)
            if not entries:
                self.router.inbox.read_now()  # a peer may have handed us jobs meanwhile
                return self.control.read(self.r), []
            free -= len(entries)
        held = len(self.jobs) + len(entries)
        high = 0 if self.stopping or self.jobs.solo_busy else min(
            free + self.cfg.high_burst, self.max_seqs + self.cfg.high_burst - held)
        control, lanes = self.lanes.control_and_lanes(self.keys, max(0, high), max(0, free),
                                                      self.steps)
        entries += entries_from(lanes, self.keys)
        for e in entries:
            e.origin = "new"  # read fresh: routing may hand it to a peer (once, never again)
        return self.control.cancels(control), sorted(entries, key=lambda e: LANES.index(e.lane))

    def step_and_publish(self) -> None:
        if self.engine.has_unfinished_requests():
            t0 = time.perf_counter()
            outputs = self.engine.step()
            self.timing["engine_s"] += time.perf_counter() - t0
            self.steps += 1
            self.step_ends.append(time.time())
            for out in outputs:
                self.collector.collect(out)  # token events into the outbox, ends into the table
        self.publisher.wait()  # the previous step's writes (overlapped with this step's compute)
        self.publisher.submit(self.outbox.take())

    def _flush(self) -> None:
        """Every write so far, sent and landed."""
        self.publisher.wait()
        self.publisher.submit(self.outbox.take())
        self.publisher.wait()

    def _refresh_lanes(self) -> None:
        self.keys = publish_shards(self.r, self.keys)  # may be more shards than we were told
        ensure_groups(self.r, self.keys)

    def _give_up(self) -> bool:
        return self.stopping and (not self.jobs or time.monotonic() >= self.drain_deadline)

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # in-process test workers are stopped with stop()
        signal.signal(signal.SIGTERM, lambda *_: self.stop())
        signal.signal(signal.SIGINT, lambda *_: self.stop())

    def stop(self, drain_timeout_s: Optional[float] = None) -> None:
        """Stop pulling work; finish what is in flight within the drain timeout. Twice: now."""
        timeout = self.cfg.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        if self.stopping:
            timeout = 0.0
        self.stopping = True
        self.drain_deadline = time.monotonic() + timeout
        self._stop_event.set()
        log.info("worker %s draining (%d in flight, %.1f s)", self.name, len(self.jobs), timeout)

    def finish(self) -> None:
        self.publisher.wait()
        self.outbox.flush(self.r)
        self.heartbeat.leave()

    def _beat(self) -> None:  # the lease thread's heartbeat (and prefix-index freshness)
        self.heartbeat.beat(self.status())
        self.router.touch()
        self.caps.renew()

    def status(self) -> WorkerInfo:
        """The heartbeat's document. Strict and closed: a field WorkerInfo does not know is an
        error here, not a value readers never see."""
        doc = {"model": ",".join(sorted(self.cfg.served_models)), "model_name": self.model_name,
               "pid": os.getpid(), "host": socket.gethostname(), "running": len(self.jobs),
               "state": "draining" if self.stopping else "running", "steps": self.steps,
               **self.counts, **{k: round(v, 3) for k, v in self.timing.items()},
               **self.router.status()}
        unknown = doc.keys() - WorkerInfo.model_fields.keys()
        if unknown:
            raise TypeError(f"worker status fields WorkerInfo lacks: {sorted(unknown)}")
        return WorkerInfo.model_validate(doc)
