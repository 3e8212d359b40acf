"""Observer hooks of the worker loop: how metrics and Flower events see what a worker does.

The worker calls `Observers.emit(hook, ...)` at a handful of points (see `WorkerObserver`); all
the logic lives in the observers (workers/integrations/metrics.py, workers/integrations/flower_events.py), so the loop stays
readable and an observer bug can never take a worker down: a failing hook is logged and skipped.
Hooks run on the worker loop's thread, between engine steps: they must be cheap and must not
block for long (the step's latency is every job's inter-token latency).
"""
from __future__ import annotations

import logging
import time

log = logging.getLogger("genpool.worker")


class WorkerObserver:
    """Base class: override the hooks you need; every hook defaults to doing nothing."""

    def worker_started(self, worker) -> None:
        """The worker joined the consumer group and is about to read jobs."""

    def job_received(self, verdict) -> None:
        """An entry was read and its job id checked (a workers.job.Job: .claim, .req, .job_id,
        .attempt); it is about to be started, rejected or acknowledged as a duplicate."""

    def job_started(self, job) -> None:
        """A job (workers.job.Job) entered the engine."""

    def job_token(self, job, ev) -> None:
        """A job produced new tokens this step (schemas.TokenEvent)."""

    def job_finished(self, job, ev) -> None:
        """A job ended with a result (schemas.ResultEvent)."""

    def job_failed(self, job_id: str, ev, job=None) -> None:
        """A job ended with an error (schemas.ErrorEvent); `job` is None when it never started."""

    def tick(self, worker) -> None:
        """Once per loop iteration (after the step's writes were handed to the publisher); also
        while idle, at least every idle_block_ms, so periodic work (heartbeats) can hang here."""

    def worker_stopped(self, worker) -> None:
        """The loop ended (drained, or released its unfinished jobs)."""


class Observers(list):
    """The worker's observer list; `emit` isolates the worker from observer failures."""

    _LOG_EVERY_S = 30.0

    def __init__(self, *items):
        super().__init__(items)
        self._last_log: dict[str, float] = {}

    def emit(self, hook: str, *args) -> None:
        for ob in self:
            try:
                getattr(ob, hook)(*args)
            except Exception:  # rate-limited: a broken hook would otherwise log every step
                key = f"{type(ob).__name__}.{hook}"
                now = time.monotonic()
                if now - self._last_log.get(key, -1e9) >= self._LOG_EVERY_S:
                    self._last_log[key] = now
                    log.exception("observer hook %s failed (worker continues)", key)
