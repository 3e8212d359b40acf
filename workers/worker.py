"""The resident worker: Redis lane streams -> one engine -> per-job Redis event streams.

Read `Worker.run` and `Worker.tick` top to bottom; each line is one stage of a step. The worker
composes its parts: `Admission` (workers/admit.py) turns entries into jobs, `JobTable`
(workers/jobs.py) holds them and ends each one, the `Outbox` and `Publisher` write, the
`LeaseKeeper` renews, the `Router` routes by prefix, `Recovery` rides out a lost Redis. Every
Redis key comes from genpool.schemas.keys; docs/protocol.md describes the wire format.
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
from genpool.schemas.scripting import pipelined
from genpool.schemas.workers import WorkerInfo
from genpool.workers.admission import Admitter
from genpool.workers.admit import Admission
from genpool.workers.caps import ConcurrencyCaps
from genpool.workers.fair import FAIR_READ, FairPull
from genpool.workers.heartbeat import Heartbeat
from genpool.workers.job import DONE, Entry, Outcome
from genpool.workers.jobs import JobTable
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
    lane_budgets,
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
        self.steps, self.idle_reads, self.started = 0, 0, False  # idle_reads: the next shard
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
        handed = [] if self.stopping or self.jobs.solo_busy else self.router.take(
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
            entries = self._blocking_read(free)
            if not entries:
                self.router.read_inbox_now()  # a peer may have handed us jobs meanwhile
                return self.control.read(self.r), []
            free -= len(entries)
        held = len(self.jobs) + len(entries)
        high = 0 if self.stopping or self.jobs.solo_busy else min(
            free + self.cfg.high_burst, self.max_seqs + self.cfg.high_burst - held)
        control, lanes = self._control_and_lanes(max(0, high), max(0, free))
        entries += entries_from(lanes, self.keys)
        for e in entries:
            e.origin = "new"  # read fresh: routing may hand it to a peer (once, never again)
        return self.control.cancels(control), sorted(entries, key=lambda e: LANES.index(e.lane))

    def _control_and_lanes(self, high: int, free: int) -> tuple:
        """The control read, the router's look at our PEL (entries peers handed us) and
        FAIR_READ_LUA (READ_LUA with tenants' fair turns: workers/fair.py) once per lane
        shard, in one pipeline round trip (one per node in a cluster)."""
        inbox = self.router.inbox_reads()
        reads = [self.control.queue_read, *inbox]
        for shard, h, f in lane_budgets(self.keys.lane_shards, high, free, self.steps):
            reads.append(lambda pipe, shard=shard, h=h, f=f: self.fair.queue_read(
                pipe, self.keys, shard, h, f, self.caps.full))
        control, *rest = pipelined(self.r, reads, lambda pipe, q: q(pipe), [FAIR_READ],
                                   raise_errors=True)
        if inbox:
            self.router.inbox(rest[:len(inbox)])
        return control, [stream for reply in rest[len(inbox):] for stream in reply or []]

    def _blocking_read(self, free: int) -> list[Entry]:
        # One BLOCK call over one shard's lanes (one hash slot, so a cluster allows it), a
        # different shard each time; COUNT applies per stream, so split the room three ways.
        shards = self.keys.lane_shards
        shard = self.idle_reads % shards
        lanes = self.keys.shard_lanes(shard)
        self.idle_reads += 1
        # tenants' sub-streams wake no blocked read: look at the shard's fair turns first, taking
        # no more than the blocking read below would (a third of the room): an idle worker that
        # took every queued job would leave its peers (and prefix routing) nothing
        n = max(1, free // len(LANES))
        entries = entries_from(pipelined(self.r, [shard], lambda pipe, k: self.fair.queue_read(
            pipe, self.keys, k, n, n, self.caps.full), [FAIR_READ], raise_errors=True)[0],
            self.keys)
        if entries:
            for e in entries:
                self.router.note(e)
            return entries
        # with routing on, a peer may hand this idle worker a job (an XCLAIM, which wakes no
        # blocked read): wait at most 50 ms between looks at our own pending entries
        block = min(self.cfg.idle_block_ms, 50) if self.router.enabled else self.cfg.idle_block_ms
        block = self.fair.idle_block_ms(block)  # while tenants exist, look again soon
        reply = self.r.xreadgroup(self.keys.group, self.name, {k: ">" for k in lanes},
                                  count=max(1, free // len(LANES)), block=max(10, block // shards))
        entries = entries_from(reply, self.keys)  # poll() orders by lane
        for e in entries:  # ours, not a hand-off, when the next pipeline lists our PEL
            self.router.note(e)
        return entries

    def step_and_publish(self) -> None:
        if self.engine.has_unfinished_requests():
            t0 = time.perf_counter()
            outputs = self.engine.step()
            self.timing["engine_s"] += time.perf_counter() - t0
            self.steps += 1
            self.step_ends.append(time.time())
            for out in outputs:
                self._collect(out)
        self.publisher.wait()  # the previous step's writes (overlapped with this step's compute)
        self.publisher.submit(self.outbox.take())

    def _collect(self, out) -> None:
        job = self.jobs.of_output(out.request_id)
        if job is None:
            return
        if out.prompt_token_ids:
            job.prompt_tokens = len(out.prompt_token_ids)
        if out.error is not None:  # the engine failed this request alone (e.g. its grammar did
            # not compile, or its parameters made its logits non-finite); the batch ran on
            log.warning("job %s failed in the engine: %s", job.id, out.error.message)
            self.jobs.finish(job, Outcome.failed(out.error.code, out.error.message),
                             engine_ended=True)
            return
        if out.prompt_logprobs is not None:
            job.prompt_scores = self.jobs.prompt_scores(out.prompt_token_ids, out.prompt_logprobs,
                                                     out.prompt)
        for c in out.outputs:
            ev = job.add_delta(c.index, c.text, c.token_ids, c.finish_reason, c.logprobs)
            if ev is not None:
                if c.index == 0 and out.prompt_logprobs is not None:  # streamed echo reads it
                    ev.prompt = job.prompt_scores
                if ev.logprobs:  # their tokens' texts, for readers without the tokenizer
                    ev.token_texts = self.jobs.token_texts(ev.logprobs)
                    job.token_texts.update(ev.token_texts)
                if not job.recorded:  # what a worker that takes the job over must know
                    ev.model_identity, ev.seed, job.recorded = self.jobs.identity_doc, out.seed, True
                if job.ttft_steps is None and not job.resumed:  # engine steps since arrival
                    job.ttft_steps = sum(t > job.entry.enqueued_at for t in self.step_ends)
                self.outbox.token(job, ev)
                self.observers.emit("job_token", job, ev)
        if out.finished:
            self.jobs.finish(job, DONE, engine_ended=True)

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
