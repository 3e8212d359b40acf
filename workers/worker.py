"""The resident worker: Redis lane streams -> one engine -> per-job Redis event streams.

Read `Worker.run` and `Worker.tick` top to bottom; each line is one stage of a step. Every Redis
key comes from schemas.keys; docs/protocol.md describes the wire format.
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

from producer.protocol import backoff
from schemas import LANES, ErrorEvent, Keys

from .admission import Admitter, free_capacity
from .heartbeat import Heartbeat
from .intake import Entry
from .jobstate import InFlight
from .observe import Observers
from .outbox import Outbox
from .publisher import Publisher
from .streams import (READ_LUA, ControlReader, ensure_groups, entries_from,
                      own_pending, reclaim, refresh_claims)
from .worker_config import WorkerConfig

log = logging.getLogger("genpool.worker")
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)


class Worker:
    def __init__(self, engine, r: redis.Redis, keys: Keys, cfg: WorkerConfig):
        self.engine, self.r, self.keys, self.cfg = engine, r, keys, cfg
        self.name = cfg.name
        self.inflight: dict[str, InFlight] = {}
        self.outbox = Outbox(keys, self.name, cfg.events_maxlen, cfg.result_ttl_s, cfg.job_ttl_s)
        # metrics / Flower events (workers/observe.py); the outbox reports every job's end
        self.observers = self.outbox.observers = Observers()
        self.admitter = Admitter(r, keys, self.name, cfg.served_models, self.outbox,
                                 cfg.max_deliveries, cfg.job_ttl_s)
        self.heartbeat = Heartbeat(r, keys, self.name, cfg.heartbeat_s)
        self.publisher = Publisher(self.outbox, r)
        self._read = r.register_script(READ_LUA)
        st = engine.stats()
        self.max_seqs = cfg.max_inflight or (st["free_seq_slots"] + st["num_running"]
                                             + st["num_waiting"])
        self.kv_total, self.block_size = st["kv_blocks_total"], st.get("block_size", 16)
        self.steps = 0
        self.step_ends: deque[float] = deque(maxlen=256)  # wall-clock end of recent steps
        self.started = False
        self.control = ControlReader(keys)
        self.claim_cursors: dict[str, str] = {}
        self.next_upkeep = 0.0
        self.stopping, self.drain_deadline = False, float("inf")
        self.counts = {"done": 0, "failed": 0, "reconnects": 0}
        # busy loop time vs time inside engine.step(): the queue's overhead, shown in heartbeats
        self.timing = {"busy_s": 0.0, "engine_s": 0.0}
        self._stop_event = threading.Event()

    # -- the loop ------------------------------------------------------------------------
    def run(self) -> int:
        self._install_signals()
        while not self.started and not self._done():
            self._guarded(self.start)
        while not self._done():
            t0 = time.perf_counter()
            self._guarded(self.tick)
            if self.inflight or self.engine.has_unfinished_requests():
                self.timing["busy_s"] += time.perf_counter() - t0
        self._release_unfinished()
        for _ in range(3):
            if self._guarded(self.finish, attempts=3):
                break
        self.publisher.close()
        self.observers.emit("worker_stopped", self)
        log.info("worker %s stopped: %s", self.name, self.counts)
        return 0

    def start(self) -> None:
        ensure_groups(self.r, self.keys)
        self.control.start_at_tail(self.r)
        self.admit(own_pending(self.r, self.keys, self.name, self.max_seqs))
        self.heartbeat.beat(self.status())
        self.started = True
        self.observers.emit("worker_started", self)
        log.info("worker %s ready (prefix %s, %d slots, models %s)", self.name, self.keys.prefix,
                 self.max_seqs, sorted(self.cfg.served_models))

    def tick(self) -> None:
        self.upkeep()  # heartbeat; keep our entries claimed; take over dead workers' entries
        cancels, entries = self.poll()  # one round trip while full: control + high lane
        self.cancel(cancels)  # aborts within this step, frees the KV blocks
        self.admit(entries)  # validate, ownership check, engine.add_request
        self.expire()  # deadlines passed while running
        self.step_and_publish()  # one engine step, then ONE MULTI with every write of the step
        self.observers.emit("tick", self)  # metrics snapshot, Flower heartbeat

    def _done(self) -> bool:
        if not self.stopping:
            return False
        idle = not self.inflight and not len(self.outbox) and self.publisher.idle
        return idle or time.monotonic() >= self.drain_deadline

    # -- stages --------------------------------------------------------------------------
    def upkeep(self) -> None:
        if time.monotonic() < self.next_upkeep:
            return
        self.next_upkeep = time.monotonic() + min(self.cfg.heartbeat_s,
                                                  self.cfg.claim_idle_ms / 3000)
        self.heartbeat.beat(self.status())
        self.publisher.wait()  # acks in flight must land first, or we would reclaim our own
        refresh_claims(self.r, self.keys, self.name, [j.entry for j in self.inflight.values()])
        free = self.capacity()
        if not self.stopping and free > 0:
            self.admit(reclaim(self.r, self.keys, self.name, self.cfg.claim_idle_ms, free,
                               self.claim_cursors))

    def capacity(self) -> int:
        """How many more jobs fit: sequence slots, and KV blocks for their worst case."""
        return free_capacity(self.engine.stats(), list(self.inflight.values()), self.max_seqs,
                             self.kv_total, self.block_size)

    def poll(self) -> tuple[list[str], list[Entry]]:
        """Cancels from the control stream, and new entries sized to what the engine can hold.
        The high lane is read every step, even when full, so interactive work can preempt."""
        free = 0 if self.stopping else self.capacity()
        entries: list[Entry] = []
        idle = not (self.inflight or self.engine.has_unfinished_requests() or len(self.outbox))
        if idle and free > 0:  # nothing to step: wait for work (bounded, so upkeep still runs)
            entries = self._blocking_read(free)
            if not entries:
                return self.control.read(self.r), []
            free -= len(entries)
        held = len(self.inflight) + len(entries)
        high = 0 if self.stopping else min(free + self.cfg.high_burst,
                                           self.max_seqs + self.cfg.high_burst - held)
        control, lanes = self._control_and_lanes([self.keys.group, self.name, max(0, high), max(0, free)])
        entries += entries_from(lanes, self.keys)
        return self.control.cancels(control), sorted(entries, key=lambda e: LANES.index(e.lane))

    def _control_and_lanes(self, args: list) -> tuple:
        """The control read and READ_LUA in one pipeline round trip. EVALSHA by hand: a registered
        Script on a pipeline costs a SCRIPT EXISTS round trip on every execute()."""
        lanes = self.keys.all_jobs()
        for attempt in (0, 1):
            pipe = self.r.pipeline(transaction=False)
            self.control.queue_read(pipe)
            pipe.evalsha(self._read.sha, len(lanes), *lanes, *args)
            try:
                return tuple(pipe.execute())
            except redis.exceptions.NoScriptError:  # Redis restarted or flushed: load it, again
                if attempt:
                    raise
                self.r.script_load(READ_LUA)

    def _blocking_read(self, free: int) -> list[Entry]:
        # One BLOCK call over all lanes; COUNT applies per stream, so split the room three ways.
        per = max(1, free // len(LANES))
        reply = self.r.xreadgroup(self.keys.group, self.name,
                                  {k: ">" for k in self.keys.all_jobs()}, count=per,
                                  block=self.cfg.idle_block_ms)
        return entries_from(reply, self.keys)  # poll() orders by lane

    def cancel(self, job_ids: list[str]) -> None:
        for job_id in job_ids:
            if job_id in self.inflight:
                self._abort(job_id, ErrorEvent(code="cancelled", message="cancelled by request"))

    def admit(self, entries: list[Entry]) -> None:
        # Entry ids are per stream (lanes can share one), so key by both.
        running = {(j.entry.stream, j.entry.entry_id) for j in self.inflight.values()}
        entries = [e for e in entries if (e.stream, e.entry_id) not in running]  # ours already
        if not entries:
            return
        for v in self.admitter.verdicts(entries):
            self.observers.emit("job_received", v)
            if self.admitter.settle(v) is None:
                continue
            job = self.admitter.start(self.engine, v)
            if job is not None:
                self.inflight[job.id] = job
                self.observers.emit("job_started", job)

    def expire(self) -> None:
        now = time.time()
        for job in list(self.inflight.values()):
            if job.req.deadline is not None and job.req.deadline < now:
                n = sum(len(v) for v in job.ids.values())
                self._abort(job.id, ErrorEvent(
                    code="expired", message=f"deadline passed after {n} generated tokens"))

    def _abort(self, job_id: str, ev: ErrorEvent) -> None:
        job = self.inflight.pop(job_id)
        self.engine.abort_request(job_id)
        self.outbox.error(job_id, job.entry, ev, job)
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
        job = self.inflight.get(out.request_id)
        if job is None:  # cancelled or expired: already answered
            return
        if out.prompt_token_ids:
            job.prompt_tokens = len(out.prompt_token_ids)
        for c in out.outputs:
            ev = job.add_delta(c.index, c.text, c.token_ids, c.finish_reason, c.logprobs)
            if ev is not None:
                if job.ttft_steps is None:  # engine steps that ended since the job arrived
                    job.ttft_steps = sum(t > job.entry.enqueued_at for t in self.step_ends)
                self.outbox.token(job.id, ev)
                self.observers.emit("job_token", job, ev)
        if out.finished:
            del self.inflight[job.id]
            self.outbox.result(job, job.result(self.name))
            self.counts["done"] += 1

    # -- robustness ----------------------------------------------------------------------
    def _guarded(self, fn, attempts: Optional[int] = None) -> bool:
        """Run a stage; on Redis loss, reconnect with backoff and keep every job (nothing acked
        is lost: acks only ever travel with their results). True when the stage completed."""
        try:
            fn()
            return True
        except REDIS_DOWN as e:
            log.warning("Redis connection lost (%s); reconnecting", e)
            self.publisher.settle()  # its failed ops return to the outbox first
            self._reconnect(attempts)
        except redis.ResponseError as e:
            if "NOGROUP" in str(e) or "UNBLOCKED" in str(e):
                log.warning("lane streams or groups vanished (%s); recreating", e)
                self._guarded(lambda: ensure_groups(self.r, self.keys))
            else:  # e.g. a key of the wrong type: keep serving, but loudly and not in a hot loop
                log.error("Redis refused a command: %s", e)
                self._stop_event.wait(1.0)
        return False

    def _reconnect(self, attempts: Optional[int]) -> None:
        delays = backoff(0.1, 5.0)
        tries = 0
        while attempts is None or tries < attempts:
            tries += 1
            if self.stopping and (not self.inflight or time.monotonic() >= self.drain_deadline):
                return  # nothing left worth waiting for Redis
            try:
                self.r.ping()
                ensure_groups(self.r, self.keys)
                self.counts["reconnects"] += 1
                self.outbox.after_failure(list(self.inflight.values()))  # Redis may have lost
                log.info("reconnected to Redis")  # the last writes (restart without fsync)
                return
            except REDIS_DOWN:
                self._stop_event.wait(next(delays))

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

    def _release_unfinished(self) -> None:
        """Jobs still running at the drain deadline stay unacknowledged: after claim_idle_ms
        another worker reclaims them and reruns them (their readers see a restart)."""
        if self.inflight:
            log.warning("releasing %d unfinished jobs to other workers", len(self.inflight))
            self.engine.abort_request(list(self.inflight))
            self.inflight.clear()

    def finish(self) -> None:
        self.publisher.wait()
        self.outbox.flush(self.r)
        self.heartbeat.leave()

    def status(self) -> dict:
        return {"model": ",".join(sorted(self.cfg.served_models)), "pid": os.getpid(),
                "host": socket.gethostname(), "running": len(self.inflight),
                "state": "draining" if self.stopping else "running", "steps": self.steps,
                **self.counts, **{k: round(v, 3) for k, v in self.timing.items()}}
