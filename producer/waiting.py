"""What a producer does while it waits on a job, shared by the sync and asyncio clients (no I/O).

A wait must never be silent about what it waits on: `Watch` decides when to look at the live
workers (every CHECK_S while nothing arrives), when the lack of a live worker for the job's model
becomes a `NoWorkers` error (at the caller's timeout, or after `no_worker_s` when given), and when
a Redis that stopped answering becomes a `QueueUnavailable` error (after `reconnect_s`). The
first connection loss and every give-up are logged on the `genpool.client` logger.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

from genpool.schemas import ErrorEvent, JobResult, ResultEvent
from genpool.schemas.connection import backoff, redact

from .errors import JobFailed, NoWorkers, QueueUnavailable

log = logging.getLogger("genpool.client")
CHECK_S = 2.0  # how often a waiting reader looks at the live workers
RECONNECT_S = 30.0  # how long a waiting reader retries a Redis that stopped answering


class Watch:
    def __init__(self, job_id: str, model: Optional[str], prefix: str, url: str,
                 timeout: Optional[float], no_worker_s: Optional[float],
                 reconnect_s: float = RECONNECT_S):
        # `url` only goes into log lines and errors: never with its password
        self.job_id, self.model, self.prefix, self.url = job_id, model, prefix, redact(url)
        now = time.monotonic()
        self.t0 = now
        self.deadline = None if timeout is None else now + timeout
        self.no_worker_s, self.reconnect_s = no_worker_s, reconnect_s
        # without a timeout or a grace nothing would act on what a check finds: skip them
        self.checks = timeout is not None or no_worker_s is not None
        self.next_check = now  # look at once: a job for nobody should be reported early
        self.last_check = float("-inf")
        self.unserved_since: Optional[float] = None
        self.started = False  # events came: a worker took the job (and may have left since)
        self.down_since: Optional[float] = None
        self.failures = 0  # consecutive failed reads
        self.last_error: Optional[Exception] = None
        self.delays = backoff()  # pauses between tries of a Redis that stopped answering

    def block_ms(self, cap_ms: int) -> int:
        """XREAD BLOCK until the next thing to decide (never 0: that would block forever)."""
        ends = [self.next_check] if self.checks else []
        if self.deadline is not None:
            ends.append(self.deadline)
        if not ends:
            return cap_ms
        return max(1, min(cap_ms, int((min(ends) - time.monotonic()) * 1000)))

    def attempt_s(self, grace_s: float = 1.0) -> Optional[float]:
        """How long one Redis call may take before the wait gives up on it (None: no bound but
        the connection's socket timeout). A healthy read ends within its BLOCK, which block_ms
        keeps inside the deadline; the grace covers a loaded machine's round trip."""
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - time.monotonic()) + grace_s

    def check_due(self) -> bool:
        return self.checks and time.monotonic() >= self.next_check

    def saw_workers(self, n_serving: int) -> None:
        now = time.monotonic()
        # a wait bounded only by no_worker_s (the gateway's 60 s) looks less often: every open
        # request's look reads the workers hash and each heartbeat
        every = CHECK_S if self.deadline is not None or self.no_worker_s is None else max(CHECK_S, self.no_worker_s / 10)
        self.next_check, self.last_check = now + every, now
        if n_serving:
            self.unserved_since = None
        elif self.unserved_since is None:
            self.unserved_since = now

    def saw_events(self) -> None:
        """Entries arrived: someone serves the job (a draining worker is no longer listed)."""
        self.unserved_since, self.started = None, True

    def redis_ok(self) -> None:
        if self.failures >= 2:
            log.warning("job %s: Redis at %s answers again", self.job_id, self.url)
        self.down_since, self.failures, self.last_error = None, 0, None
        self.delays = backoff()

    def redis_failed(self, err: Exception) -> None:
        now = time.monotonic()
        self.failures += 1
        if self.down_since is None:
            self.down_since = now
        if self.failures == 2:  # one failed read is retried quietly (a blip on a loaded machine)
            log.warning("job %s: lost the connection to Redis at %s (%s); retrying for up to "
                        "%.0f s", self.job_id, self.url, err, self.reconnect_s)
        if now - self.down_since >= self.reconnect_s:
            raise QueueUnavailable(self.url, now - self.down_since, err)

    def retry_after(self, err: Exception) -> float:
        """A call failed on a lost or stalled Redis: the pause before the next try. Raises
        QueueUnavailable after reconnect_s, and TimeoutError once the caller's timeout is spent:
        a wait never retries past its own deadline."""
        self.redis_failed(err)
        self.last_error = err
        pause = next(self.delays)
        if self.deadline is None:
            return pause
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise self.timed_out()
        return min(pause, left)

    def timed_out(self) -> TimeoutError:
        msg = f"job {self.job_id}: no final event within {self.deadline - self.t0:g} s"
        if self.last_error is not None:
            msg += f" (Redis at {self.url} has not answered: {self.last_error})"
        return TimeoutError(msg)

    def after_read(self) -> None:
        """Raise when the wait is over: NoWorkers or TimeoutError."""
        now = time.monotonic()
        unserved = self.unserved_since is not None
        if unserved and self.no_worker_s is not None and now - self.unserved_since >= self.no_worker_s:
            raise NoWorkers(self.job_id, self.model, self.prefix, now - self.t0, self.started)
        if self.deadline is not None and now >= self.deadline:
            if unserved and self.checks and self.last_check < self.deadline:
                self.next_check = now  # decide on a fresh look: a worker may have come since
                return
            if unserved:
                raise NoWorkers(self.job_id, self.model, self.prefix, now - self.t0, self.started)
            raise self.timed_out()


def final_result(job_id: str, final, text: str = "", token_ids: Optional[list] = None,
                 raise_on_error: bool = True) -> JobResult:
    """The JobResult for a terminal event. A cancelled job keeps what was streamed before the
    cancel (`text`, `token_ids`) with finish_reason "cancelled"; any other error raises JobFailed
    unless `raise_on_error` is False."""
    if isinstance(final, ResultEvent):
        return JobResult.from_event(job_id, final)
    assert isinstance(final, ErrorEvent)
    if final.code == "cancelled":
        return JobResult(id=job_id, text=text, token_ids=list(token_ids or []),
                         finish_reason="cancelled", error=final)
    res = JobResult.from_event(job_id, final)
    if raise_on_error:
        raise JobFailed(res)
    return res
