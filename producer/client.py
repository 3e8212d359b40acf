"""Synchronous producer: submit jobs, stream their tokens, wait for results, cancel."""
from __future__ import annotations

import time
from typing import Any, Iterator, Optional

import redis

from schemas import TERMINAL, JobResult, Keys, RestartEvent, TokenEvent

from .config import key_prefix, redis_url
from .protocol import (CANCEL_LUA, JOB_TTL_S, READ_COUNT, SUBMIT_LUA, backoff, block_ms,
                       build_request, cancel_args, events_in, last_terminal, submit_args,
                       terminal_from_hash)
from .replay import Replay

PIPELINE_CHUNK = 500
_RETRY = (redis.ConnectionError, redis.TimeoutError)


class Job:
    """Handle on one submitted job. `duplicate` is True when the id already existed."""

    def __init__(self, client: "Client", job_id: str, duplicate: bool = False):
        self.client, self.id, self.duplicate = client, job_id, duplicate
        self._final: Optional[JobResult] = None

    def __repr__(self) -> str:
        return f"Job({self.id!r})"

    def events(self, timeout: Optional[float] = None, start: str = "0-0") -> Iterator[Any]:
        """Raw events from `start` up to and including the terminal one (reconnects on loss)."""
        r, key = self.client.redis, self.client.keys.events(self.id)
        deadline = None if timeout is None else time.monotonic() + timeout
        last, delays = start, backoff()
        while True:
            try:
                resp = r.xread({key: last}, count=READ_COUNT, block=block_ms(deadline))
                delays = backoff()
            except _RETRY:
                resp = None
                time.sleep(next(delays))
            for entry_id, ev in events_in(resp):
                last = entry_id
                yield ev
                if ev.type in TERMINAL:
                    return
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job {self.id}: no final event within {timeout} s")

    def stream(self, timeout: Optional[float] = None) -> Iterator[TokenEvent | RestartEvent]:
        """Token events from the start; a RestartEvent only if a rerun diverged (see replay.py)."""
        replay = Replay()
        for raw in self.events(timeout):
            for ev in replay.feed(raw):
                if ev.type in TERMINAL:
                    self._final = JobResult.from_event(self.id, ev)
                else:
                    yield ev

    def result(self, timeout: Optional[float] = None) -> JobResult:
        if self._final is None:
            self._final = self._wait_final(timeout)
        return self._final

    def _wait_final(self, timeout: Optional[float]) -> JobResult:
        # One MULTI: the stored result, or else the stream's last id to wait beyond; the worker
        # writes both in one MULTI too, so nothing can slip between the two reads.
        keys = self.client.keys

        def snapshot():  # a fresh pipeline per try: execute() empties it even when it fails
            pipe = self.client.redis.pipeline(transaction=True)
            pipe.hmget(keys.job(self.id), "result", "error")
            pipe.xrevrange(keys.events(self.id), count=1)
            return pipe.execute()

        (res, err), last = _retrying(snapshot)
        final = terminal_from_hash(res, err) or last_terminal(last)
        if final is None:  # not finished: wait for events after the last one that exists now
            start = last[0][0] if last else "0-0"
            final = next(ev for ev in self.events(timeout, start=start) if ev.type in TERMINAL)
        return JobResult.from_event(self.id, final)

    def cancel(self) -> None:
        self.client.cancel(self.id)

    def info(self) -> dict:
        return self.client.redis.hgetall(self.client.keys.job(self.id))


def _retrying(fn, attempts: int = 8):
    delays = backoff()
    for i in range(attempts):
        try:
            return fn()
        except _RETRY:
            if i == attempts - 1:
                raise
            time.sleep(next(delays))


class Client:
    def __init__(self, url: Optional[str] = None, prefix: Optional[str] = None, *,
                 redis_client: Optional[redis.Redis] = None, job_ttl_s: int = JOB_TTL_S):
        self.url = redis_url(url)
        self.keys = Keys(key_prefix(prefix))
        self.redis = redis_client or redis.Redis.from_url(self.url, decode_responses=True)
        self.job_ttl_s = job_ttl_s
        self._submit = self.redis.register_script(SUBMIT_LUA)
        self._cancel = self.redis.register_script(CANCEL_LUA)
        self._raw: Optional[redis.Redis] = None

    def close(self) -> None:
        self.redis.close()
        if self._raw is not None:
            self._raw.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def submit(self, prompt: Optional[str] = None, **kwargs: Any) -> Job:
        """kwargs: messages, model, priority, job_id, deadline, metadata, and SamplingParams names."""
        req = build_request(prompt, **kwargs)
        entry = _retrying(lambda: self._submit(keys=[self.keys.job(req.id),
                                                     self.keys.jobs(req.lane)],
                                               args=submit_args(req, self.job_ttl_s)))
        return Job(self, req.id, duplicate=entry is None)

    def submit_many(self, requests: list[dict]) -> list[Job]:
        """Validate all, then enqueue in pipelined chunks (one round trip per chunk)."""
        reqs = [build_request(**dict(r)) for r in requests]
        jobs: list[Job] = []
        for i in range(0, len(reqs), PIPELINE_CHUNK):
            chunk = reqs[i:i + PIPELINE_CHUNK]
            entries = _retrying(lambda chunk=chunk: self._submit_chunk(chunk))
            jobs += [Job(self, q.id, duplicate=e is None) for q, e in zip(chunk, entries)]
        return jobs

    def map(self, items, concurrency: int = 16, **common):
        """Run every item (prompt string or dict of submit kwargs) with at most `concurrency`
        jobs in flight; JobResults in input order (see producer.pipeline.map_prompts)."""
        from producer.pipeline import map_prompts

        return map_prompts(self, items, concurrency=concurrency, **common)

    def _submit_chunk(self, chunk: list) -> list:
        # Retrying is safe: the script skips ids that already exist (a chunk that half-landed
        # before a connection loss reports those as duplicates, and runs each job once).
        pipe = self.redis.pipeline(transaction=False)
        for req in chunk:
            self._submit(keys=[self.keys.job(req.id), self.keys.jobs(req.lane)],
                         args=submit_args(req, self.job_ttl_s), client=pipe)
        return pipe.execute()

    def job(self, job_id: str) -> Job:
        return Job(self, job_id)

    def cancel(self, job_id: str) -> None:
        # The flag stops a job no worker has started; the control entry reaches the one running it.
        _retrying(lambda: self._cancel(keys=[self.keys.job(job_id), self.keys.control],
                                       args=cancel_args(job_id, self.job_ttl_s)))

    def status(self) -> dict:
        from .status import queue_status

        if self._raw is None:  # bytes in, decoded leniently: status must never choke on junk
            pool = self.redis.connection_pool  # the caller's connection settings (TLS, auth, ...)
            kwargs = {**pool.connection_kwargs, "decode_responses": False}
            self._raw = redis.Redis(connection_pool=redis.ConnectionPool(
                connection_class=pool.connection_class, **kwargs))
        return queue_status(self._raw, self.keys)
