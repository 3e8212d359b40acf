"""Exceptions a producer raises while waiting on a job (redis + pydantic only).

- `JobFailed`: the job ended with an error (unknown model, invalid request, expired, dead-lettered,
  internal). `Job.result()` raises it by default; `result(raise_on_error=False)` returns the
  JobResult with `.error` set instead. A *cancelled* job is not a failure: its result keeps the
  text streamed before the cancel and says `finish_reason="cancelled"`.
- `NoWorkers`: the wait ended (timeout, or the no-worker grace) while no live worker serves the
  job's model on the key prefix. A TimeoutError, so code that catches timeouts still works.
- `QueueUnavailable`: Redis stopped answering mid-wait and did not come back within the retry
  window. A redis.ConnectionError, so code that catches those still works.
"""
from __future__ import annotations

from typing import Optional

import redis

from genpool.schemas import ErrorEvent, JobResult
from genpool.schemas.connection import redact, redact_text


class JobFailed(Exception):
    """The job ended with an error; `.code` and `.message` are the worker's, `.result` the
    JobResult (with `.error`)."""

    def __init__(self, result: JobResult):
        err = result.error or ErrorEvent(code="internal", message="unknown failure")
        super().__init__(f"job {result.id} failed ({err.code}): {err.message}")
        self.result, self.job_id = result, result.id
        self.code, self.message = err.code, err.message


class NoWorkers(TimeoutError):
    """Not finished, and no live worker serves the job's model on this prefix: still queued, or
    `started` (tokens came) and its worker left since; it waits for the next one either way."""

    def __init__(self, job_id: str, model: Optional[str], prefix: str, waited_s: float,
                 started: bool = False):
        self.job_id, self.model, self.prefix, self.waited_s = job_id, model, prefix, waited_s
        self.started = started
        where = "started but its worker left, and" if started else "is queued but"
        super().__init__(f"job {job_id} {where} no live worker serves "
                         f"{no_worker_target(model, prefix)} (waited {waited_s:.0f} s); start one "
                         f"with `{worker_command(model, prefix)}`")


class QueueUnavailable(redis.ConnectionError):
    """Redis stopped answering while we waited for a job."""

    def __init__(self, url: str, waited_s: float, cause: Exception):
        # callers print, log and answer HTTP with this: never the password (`url` is redacted)
        self.url, self.waited_s = redact(url), waited_s
        super().__init__(f"lost the connection to Redis at {self.url} and it did not come back "
                         f"within {waited_s:.0f} s ({type(cause).__name__}: "
                         f"{redact_text(str(cause))})")


def worker_command(model: Optional[str], prefix: str) -> str:
    return (f"genpool worker --model {model or 'MODEL'}"
            f"{'' if prefix == 'genpool' else ' --prefix ' + prefix}")


def no_worker_target(model: Optional[str], prefix: str) -> str:
    return f"model {model!r} on prefix {prefix!r}" if model else f"prefix {prefix!r}"
