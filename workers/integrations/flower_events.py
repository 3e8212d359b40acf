"""Celery events from a genpool worker, so Flower shows it and its jobs like any Celery worker.

Flower builds its worker list and task table from Celery events alone: `worker-online`,
`worker-heartbeat` (with `freq`: Flower marks a worker offline 2 x freq after its last beat, so a
killed worker goes offline within ~4 s at freq=2) and `worker-offline`; `task-received`,
`task-started`, `task-succeeded` (with `runtime`), `task-failed`, `task-revoked`. This observer
sends exactly those for every job a worker runs, with the job id as the task uuid.

Jobs submitted through the Celery front door (workers/integrations/celery_app.py) are skipped,
also those the worker turns down before parsing them (unknown model): the Celery worker running
their task body already reports them under the same uuid, and two reporters of one task would make
Flower flip its name (genpool.stream), worker and state back and forth, and count it twice.

Heartbeats are sent from the worker loop's own thread (the `tick` hook), not from a timer thread:
a loop that wedges then stops beating and Flower shows it offline, which is the truth.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import platform
import time
from typing import Callable, Optional

from genpool.workers.observe import WorkerObserver

REVOKED_CODES = ("cancelled", "expired")  # error codes Celery/Flower call "revoked"

log = logging.getLogger("genpool.flower")

STREAM_TASK_NAME = "genpool.stream"  # Celery front-door jobs are `genpool.generate`
CELERY_MARK = "celery_task_id"  # metadata key the Celery task sets on the jobs it submits
RETRY_AFTER_S = 5.0  # after a failed send, wait this long before reconnecting
BUFFER_MAX = 10_000  # events kept while Redis is unreachable (oldest dropped first)


def celery_hostname(worker_name: str) -> str:
    """Celery hostnames are `name@host`; a genpool consumer name becomes `genpool@name`."""
    return worker_name if "@" in worker_name else f"genpool@{worker_name}"


def from_celery(req) -> bool:
    meta = getattr(req, "metadata", None)
    return isinstance(meta, dict) and CELERY_MARK in meta


def parsed_from_celery(parsed) -> bool:
    """Whether a job the Celery front door submitted: a job the worker turned down (unknown
    model, prompt too long) has no parsed request, so the mark is read from its entry's JSON
    (only for such jobs: they end at once, the extra parse costs nothing per token)."""
    if parsed.req is not None:
        return from_celery(parsed.req)
    try:
        obj = json.loads(parsed.entry.payload() or b"")
    except (ValueError, AttributeError, RecursionError):
        return False  # junk: only the genpool worker can report it
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    return isinstance(meta, dict) and CELERY_MARK in meta


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def job_kwargs(req) -> str:
    """A short, human-readable summary for Flower's kwargs column (never the whole prompt)."""
    if req is None:
        return "{}"
    what = ("prompt", _short(req.prompt)) if req.prompt is not None else \
        ("messages", f"[{len(req.messages)} messages]") if req.messages is not None else \
        ("prompt_token_ids", f"[{len(req.prompt_token_ids)} ids]")
    fields = {what[0]: what[1], "max_tokens": req.max_tokens, "priority": req.priority}
    if req.model:
        fields["model"] = req.model
    return repr(fields)


class FlowerEvents(WorkerObserver):
    """`dispatcher_factory()` returns an object with `send(type, **fields)` and `close()`:
    a celery EventDispatcher (see `celery_dispatcher`), or a recorder in tests."""

    def __init__(self, dispatcher_factory: Callable, hostname: str, heartbeats: bool = True,
                 freq: float = 2.0):
        self.factory, self.hostname = dispatcher_factory, hostname
        self.heartbeats, self.freq = heartbeats, freq
        self.jobs: dict[str, float] = {}  # announced job id -> monotonic start (runtime)
        self.processed = 0
        self._d = None
        self._retry_at = 0.0
        self._next_beat = 0.0
        self._buffer: collections.deque = collections.deque(maxlen=BUFFER_MAX)

    # -- sending --------------------------------------------------------------------------
    def send(self, type_: str, **fields) -> None:
        fields.setdefault("timestamp", time.time())  # when it happened, even if sent later
        self._buffer.append((type_, fields))
        self._drain()

    def _drain(self) -> None:
        if not self._buffer or (self._d is None and time.monotonic() < self._retry_at):
            return
        try:
            if self._d is None:
                self._d = self.factory()
            while self._buffer:
                t, f = self._buffer[0]
                self._d.send(t, **f)
                self._buffer.popleft()
        except Exception as e:  # Redis away: keep the events, retry later, never raise
            log.warning("Celery events not sent (%s); retrying in %.0f s", e, RETRY_AFTER_S)
            self._drop_dispatcher()
            self._retry_at = time.monotonic() + RETRY_AFTER_S

    def _drop_dispatcher(self) -> None:
        d, self._d = self._d, None
        if d is not None:
            try:
                d.close()
            except Exception:
                pass

    def _worker_fields(self, worker) -> dict:
        return {"freq": self.freq, "active": len(worker.jobs), "processed": self.processed,
                "loadavg": [round(x, 2) for x in os.getloadavg()], "sw_ident": "genpool",
                "sw_ver": "1", "sw_sys": platform.system()}

    # -- worker hooks ---------------------------------------------------------------------
    def worker_started(self, worker) -> None:
        if self.heartbeats:
            self.send("worker-online", **self._worker_fields(worker))
            self._next_beat = time.monotonic() + self.freq

    def tick(self, worker) -> None:
        if self.heartbeats and time.monotonic() >= self._next_beat:
            self._next_beat = time.monotonic() + self.freq
            self.send("worker-heartbeat", **self._worker_fields(worker))
        else:
            self._drain()  # events held back while Redis was unreachable

    def worker_stopped(self, worker) -> None:
        if self.heartbeats:
            self.send("worker-offline", **self._worker_fields(worker))
        self._drop_dispatcher()

    # -- job hooks ------------------------------------------------------------------------
    def job_received(self, job) -> None:
        if job.claim is None or not job.claim.writes or not job.job_id or parsed_from_celery(job):
            return
        self.jobs[job.job_id] = time.monotonic()
        self.send("task-received", uuid=job.job_id, name=STREAM_TASK_NAME, args="()",
                  kwargs=job_kwargs(job.req), retries=max(0, job.attempt - 1), eta=None,
                  root_id=job.job_id, parent_id=None)

    def job_started(self, job) -> None:
        if job.id in self.jobs:
            self.jobs[job.id] = time.monotonic()
            self.send("task-started", uuid=job.id)

    def job_finished(self, job, ev) -> None:
        t0 = self.jobs.pop(job.id, None)
        if t0 is None:
            return
        self.processed += 1
        result = {"text": _short(ev.text), "finish_reason": ev.finish_reason,
                  "usage": ev.usage.model_dump()}
        self.send("task-succeeded", uuid=job.id, result=repr(result),
                  runtime=round(time.monotonic() - t0, 6))

    def job_failed(self, job_id: str, ev, job=None) -> None:
        t0 = self.jobs.pop(job_id, None)
        if t0 is None:
            return
        self.processed += 1
        # Celery's own meanings: revoked = cancelled on request, or not run in time (expired)
        if ev.code in REVOKED_CODES:
            self.send("task-revoked", uuid=job_id, terminated=ev.code == "cancelled",
                      signum=None, expired=ev.code == "expired")
        else:
            self.send("task-failed", uuid=job_id, traceback="",
                      exception=f"GenerationError({ev.code!r}, {ev.message!r})",
                      runtime=round(time.monotonic() - t0, 6))


def celery_dispatcher(app, hostname: str) -> Callable:
    """A factory of EventDispatchers on a connection of their own (what
    `app.events.default_dispatcher(hostname=...)` yields, but held for the worker's lifetime
    instead of borrowed from the producer pool for one `with` block)."""
    def make():
        conn = app.connection_for_write()
        d = app.events.Dispatcher(conn, hostname=hostname, enabled=True)
        close = d.close

        def close_all():
            close()
            conn.release()

        d.close = close_all
        return d
    return make


def attach_flower_events(worker, app=None, hostname: Optional[str] = None,
                         heartbeats: bool = True, freq: float = 2.0) -> FlowerEvents:
    """Report `worker` to Flower. `heartbeats=False` inside a Celery worker, which beats itself."""
    if app is None:
        from genpool.workers.integrations.celery_app import app
    host = hostname or celery_hostname(worker.name)
    obs = FlowerEvents(celery_dispatcher(app, host), host, heartbeats=heartbeats, freq=freq)
    worker.observers.append(obs)
    return obs
