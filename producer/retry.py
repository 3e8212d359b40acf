"""The retry of one Redis command across a lost connection: `retrying` for the sync producer
(client.py, job.py, dead.py, pipeline.py); RETRY, the errors worth a retry, for aio.py's
awaitable loop too. A retried command may have landed before its connection broke, so callers
pass only commands for which a second run is harmless (reads; the submit scripts, which skip
ids that exist; the cancel flag).
"""
from __future__ import annotations

import time
from typing import Optional

import redis

from genpool.schemas.connection import backoff

# (a cluster's MOVED after a resharding: the next try goes to the key's new node)
RETRY = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterDownError,
         redis.exceptions.TryAgainError, redis.exceptions.MovedError)


def retrying(fn, attempts: int = 8, deadline: Optional[float] = None, what: str = "Redis"):
    """fn(), tried up to `attempts` times with backoff between; the last failure is raised. With
    a `deadline` (time.monotonic()), no try starts after it: TimeoutError instead, naming `what`
    (a stalled Redis holds each try for the socket timeout, 30 s)."""
    delays = backoff()
    for i in range(attempts):
        try:
            return fn()
        except RETRY as e:
            if i == attempts - 1:
                raise
            pause = next(delays)
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{what} has not answered within the timeout: {e}") from e
                pause = min(pause, left)
            time.sleep(pause)
