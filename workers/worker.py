"""The resident worker: Redis lane streams -> one engine -> per-job Redis event streams.

Read `Worker.run` and `Worker.tick` top to bottom; each line is one stage of a step. Every Redis
key comes from genpool.schemas.keys; docs/protocol.md describes the wire format.
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
from genpool.schemas import LANES, ErrorEvent, Keys
from genpool.schemas.scripts import READ_LUA
from genpool.workers.admission import Admitter, free_capacity
from genpool.workers.custody import Custody
from genpool.workers.heartbeat import Heartbeat
from genpool.workers.intake import Entry
from genpool.workers.jobstate import InFlight, job_id_of
from genpool.workers.observe import Observers
from genpool.workers.outbox import Outbox
from genpool.workers.recovery import Recovery
from genpool.workers.router import Router
from genpool.workers.streams import (
    ControlReader,
    ensure_groups,
    entries_from,
    lane_budgets,
    own_pending,
    publish_shards,
)
from genpool.workers.worker_config import WorkerConfig

log = logging.getLogger("genpool.worker")


class Worker(Custody, Recovery):
    def __init__(self, engine: Engine, r: redis.Redis, keys: Keys, cfg: WorkerConfig):
        self.engine, self.r, self.keys, self.cfg = engine, r, keys, cfg
        self.name = cfg.name
        self.inflight: dict[str, InFlight] = {}
        self.outbox = Outbox(keys, self.name, cfg.events_maxlen, cfg.result_ttl_s, cfg.job_ttl_s)
        # metrics / Flower events (workers/observe.py); the outbox reports every job's end
        self.observers = self.outbox.observers = Observers()
        self.admitter = Admitter(r, keys, self.name, cfg.served_models, self.outbox,
                                 cfg.max_deliveries, cfg.job_ttl_s, cfg.claim_idle_ms)
        self.heartbeat = Heartbeat(r, keys, self.name, cfg.heartbeat_s)
        self._init_custody(engine, r, keys, cfg)
        self._read = r.register_script(READ_LUA)
        st = engine.stats()
        self.max_seqs = cfg.max_inflight or (st.free_seq_slots + st.num_running + st.num_waiting)
        self.kv_total, self.block_size = st.kv_blocks_total, st.block_size
        self.steps = 0
        self.idle_reads = 0  # blocking reads so far: which lane shard the next one waits on
        self.step_ends: deque[float] = deque(maxlen=256)  # wall-clock end of recent steps
        self.started = False
        self.control = ControlReader(keys)
        self._init_recovery()
        self.stopping, self.drain_deadline = False, float("inf")
        self.counts = {"done": 0, "failed": 0, "reconnects": 0, "lost": 0}
        # busy loop time vs time inside engine.step(): the queue's overhead, shown in heartbeats;
        # stall_max_s: the longest time a tick kept a busy engine from stepping
        self.timing = {"busy_s": 0.0, "engine_s": 0.0, "stall_max_s": 0.0}
        self._stop_event = threading.Event()
        self.router = Router(self)  # prefix-aware routing (workers/router.py)

    @property
    def model_name(self) -> str:
        """One name for this worker's model (aliases are the other served names)."""
        return self.cfg.model_name or min(self.cfg.served_models, default="unknown")

    # -- the loop ------------------------------------------------------------------------
    def run(self) -> int:
        self._install_signals()
        while not self.started and not self._done():
            self._guarded(self.start)
        self.keeper.start()
        while not self._done():
            t0, e0 = time.perf_counter(), self.timing["engine_s"]
            busy = bool(self.inflight) or self.engine.has_unfinished_requests()
            self._guarded(self.tick)
            if busy or self.inflight:
                dt = time.perf_counter() - t0
                self.timing["busy_s"] += dt
                stall = dt - (self.timing["engine_s"] - e0)
                self.timing["stall_max_s"] = max(self.timing["stall_max_s"], stall)
        self._release_unfinished()
        self._guarded(self.router.leave, attempts=3)  # its backlog goes to a peer
        self.keeper.stop()
        for _ in range(3):
            if self._guarded(self.finish, attempts=3):
                break
        self.publisher.close()
        self.preparer.close()
        self.observers.emit("worker_stopped", self)
        log.info("worker %s stopped: %s", self.name, self.counts)
        return 0

    def start(self) -> None:
        self.keys = publish_shards(self.r, self.keys)  # may be more shards than we were told
        ensure_groups(self.r, self.keys)
        self.control.start_at_tail(self.r)
        self.admit(own_pending(self.r, self.keys, self.name, self.max_seqs))
        self.heartbeat.beat(self.status())
        self.started = True
        self.observers.emit("worker_started", self)
        log.info("worker %s ready (prefix %s, %d slots, models %s)", self.name, self.keys.prefix,
                 self.max_seqs, sorted(self.cfg.served_models))

    def tick(self) -> None:
        self.upkeep()  # take over dead workers' entries
        self.router.publish_if_due()  # our cached prefix blocks and load, for peers' routing
        self.drop_lost()  # jobs whose lease another worker took: abort, write nothing
        self.run_solo()  # a suspect job starts once the engine is empty, and runs alone
        cancels, entries = self.poll()  # one round trip while full: control + high lane
        self.cancel(cancels)  # aborts within this step, frees the KV blocks
        handed = [] if self.stopping or self.solo_queue or self.solo_job else self.router.take(
            self.capacity(backlog=False) - len(entries), self.cfg.high_burst)  # peers' hand-offs
        self.admit(entries + handed)  # validate, route, ownership check, engine.add_request
        self.expire()  # deadlines passed while running
        self.step_and_publish()  # one engine step, then ONE MULTI with every write of the step
        self.observers.emit("tick", self)  # metrics snapshot, Flower heartbeat

    def _done(self) -> bool:
        if not self.stopping:
            return False
        idle = (not self.inflight and not len(self.outbox) and self.publisher.idle
                and not self.solo_queue)
        return idle or time.monotonic() >= self.drain_deadline

    # -- stages --------------------------------------------------------------------------
    def capacity(self, backlog: bool = True) -> int:
        """How many more jobs fit: sequence slots, and KV blocks for their worst case. None
        while a suspect job waits to run, or runs, alone. Jobs peers handed us count as taken
        (`backlog`), so a worker with a hand-off backlog pulls no new entries."""
        if self.solo_queue or self.solo_job is not None:
            return 0
        return max(0, free_capacity(self.engine.stats(), list(self.inflight.values()), self.max_seqs,
                             self.kv_total, self.block_size) - self.preparer.pending
                   - (self.router.waiting if backlog else 0))

    def poll(self) -> tuple[list[str], list[Entry]]:
        """Cancels from the control stream, and new entries sized to what the engine can hold.
        The high lane is read every step, even when full, so interactive work can preempt."""
        free = 0 if self.stopping else self.capacity()
        entries: list[Entry] = []
        idle = not (self.inflight or self.engine.has_unfinished_requests() or len(self.outbox))
        if idle and free > 0:  # nothing to step: wait for work (bounded, so upkeep still runs)
            entries = self._blocking_read(free)
            if not entries:
                self.router.read_inbox_now()  # a peer may have handed us jobs meanwhile
                return self.control.read(self.r), []
            free -= len(entries)
        held = len(self.inflight) + len(entries)
        solo = self.solo_queue or self.solo_job is not None
        high = 0 if self.stopping or solo else min(free + self.cfg.high_burst,
                                           self.max_seqs + self.cfg.high_burst - held)
        control, lanes = self._control_and_lanes([self.keys.group, self.name, max(0, high), max(0, free)])
        entries += entries_from(lanes, self.keys)
        for e in entries:
            e.origin = "new"  # read fresh: routing may hand it to a peer (once, never again)
        return self.control.cancels(control), sorted(entries, key=lambda e: LANES.index(e.lane))

    def _control_and_lanes(self, args: list) -> tuple:
        """The control read and READ_LUA (once per lane shard) in one pipeline round trip (one
        per node in a cluster). EVALSHA by hand: a registered Script on a pipeline costs a
        SCRIPT EXISTS round trip on every execute(), and redis-py's cluster pipeline refuses
        the evalsha() method."""
        group, name, high, free = args
        for attempt in (0, 1):
            pipe = self.r.pipeline(transaction=False)
            self.control.queue_read(pipe)
            inbox = self.router.queue_inbox(pipe)  # our PEL: entries peers handed us
            for shard, h, f in lane_budgets(self.keys.lane_shards, high, free, self.steps):
                lanes = self.keys.shard_lanes(shard)
                pipe.execute_command("EVALSHA", self._read.sha, len(lanes), *lanes, group, name,
                                     h, f)
            try:
                control, *shards = pipe.execute()
                if inbox:
                    self.router.inbox(shards[:inbox])
                    shards = shards[inbox:]
                return control, [stream for reply in shards for stream in reply or []]
            except redis.exceptions.NoScriptError:  # Redis restarted or flushed: load it, again
                if attempt:
                    raise
                self.r.script_load(READ_LUA)

    def _blocking_read(self, free: int) -> list[Entry]:
        # One BLOCK call over one shard's lanes (one hash slot, so a cluster allows it), a
        # different shard each time; COUNT applies per stream, so split the room three ways.
        shards = self.keys.lane_shards
        per = max(1, free // len(LANES))
        lanes = self.keys.shard_lanes(self.idle_reads % shards)
        self.idle_reads += 1
        reply = self.r.xreadgroup(self.keys.group, self.name, {k: ">" for k in lanes}, count=per,
                                  block=max(10, self._idle_block_ms() // shards))
        entries = entries_from(reply, self.keys)  # poll() orders by lane
        for e in entries:  # ours, not a hand-off, when the next pipeline lists our PEL
            self.router.note(e)
        return entries

    def _idle_block_ms(self) -> int:
        """With routing on, a peer may hand this idle worker a job (an XCLAIM, which wakes no
        blocked read): wait at most 50 ms between looks at our own pending entries."""
        return min(self.cfg.idle_block_ms, 50) if self.router.enabled else self.cfg.idle_block_ms

    def expire(self) -> None:
        now = time.time()
        for job in list(self.inflight.values()):
            if job.req.deadline is not None and job.req.deadline < now:
                n = sum(len(v) for v in job.ids.values())
                self._abort(job.id, ErrorEvent(
                    code="expired", message=f"deadline passed after {n} generated tokens"))

    def _abort(self, job_id: str, ev: ErrorEvent) -> None:
        job = self.inflight.pop(job_id)
        self.engine.abort_request(job.engine_id)
        self.outbox.error(job_id, job.entry, ev, job.fence, job)
        self.keeper.drop(job.entry, job_id)
        self.counts["failed"] += 1

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
        job = self.inflight.get(job_id_of(out.request_id))
        # None: cancelled or expired, already answered. Another engine id: an earlier attempt's
        # output (its lease was lost, then this worker reran the job), never this attempt's
        if job is None or job.engine_id != out.request_id:
            return
        if out.prompt_token_ids:
            job.prompt_tokens = len(out.prompt_token_ids)
        error = out.error
        if error is not None:  # the engine failed this request alone (e.g. its grammar did not
            # compile, or its parameters made its logits non-finite); the batch ran on
            log.warning("job %s failed in the engine: %s", job.id, error.message)
            del self.inflight[job.id]
            self.outbox.error(job.id, job.entry, ErrorEvent(code=error.code,
                                                            message=error.message), job.fence, job)
            self.keeper.drop(job.entry, job.id)
            self.counts["failed"] += 1
            return
        for c in out.outputs:
            ev = job.add_delta(c.index, c.text, c.token_ids, c.finish_reason, c.logprobs)
            if ev is not None:
                if job.ttft_steps is None:  # engine steps that ended since the job arrived
                    job.ttft_steps = sum(t > job.entry.enqueued_at for t in self.step_ends)
                self.outbox.token(job.id, ev, job.fence)
                self.observers.emit("job_token", job, ev)
        if out.finished:
            del self.inflight[job.id]
            self.outbox.result(job, job.result(self.name))
            self.keeper.drop(job.entry, job.id)
            self.counts["done"] += 1

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
        log.info("worker %s draining (%d in flight, %.1f s)", self.name, len(self.inflight),
                 timeout)

    def finish(self) -> None:
        self.publisher.wait()
        self.outbox.flush(self.r)
        self.heartbeat.leave()

    def status(self) -> dict:
        return {"model": ",".join(sorted(self.cfg.served_models)), "model_name": self.model_name,
                "pid": os.getpid(),
                "host": socket.gethostname(), "running": len(self.inflight),
                "state": "draining" if self.stopping else "running", "steps": self.steps,
                **self.counts, **{k: round(v, 3) for k, v in self.timing.items()},
                **self.router.status()}
