"""asyncio producer: the same API as producer.client, on redis.asyncio.

Commands are pipelined rather than gathered: redis.asyncio's pool holds 100 connections and
gathering more concurrent commands raises MaxConnectionsError (and is slower anyway).
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Optional

import redis
import redis.asyncio as aredis

from schemas import TERMINAL, JobResult, Keys

from .client import PIPELINE_CHUNK
from .config import key_prefix, redis_url
from .protocol import (CANCEL_LUA, JOB_TTL_S, READ_COUNT, SUBMIT_LUA, backoff, block_ms,
                       build_request, cancel_args, events_in, last_terminal, submit_args,
                       terminal_from_hash)
from .replay import Replay

_RETRY = (redis.ConnectionError, redis.TimeoutError)


def _check_cancelled() -> None:
    """Raise CancelledError if this task was asked to stop: redis-py's asyncio client can swallow a
    cancel() that lands while a command is being sent (reproduced: ~1 in 8 cancels 0.5-1.5 ms into
    an XREAD BLOCK, on redis-py with Python 3.11), and the read loop would then go on forever; with
    this check it stops at its next turn, within one READ_BLOCK_MS. Python 3.10 has no
    Task.cancelling(); there the gateway's stop_task re-cancels instead."""
    task = asyncio.current_task()
    if task is not None and getattr(task, "cancelling", lambda: 0)():
        raise asyncio.CancelledError()


async def _retrying(fn, attempts: int = 8):
    delays = backoff()
    for i in range(attempts):
        try:
            return await fn()
        except _RETRY:
            if i == attempts - 1:
                raise
            await asyncio.sleep(next(delays))


class AsyncJob:
    def __init__(self, client: "AsyncClient", job_id: str, duplicate: bool = False):
        self.client, self.id, self.duplicate = client, job_id, duplicate
        self._final: Optional[JobResult] = None

    def __repr__(self) -> str:
        return f"AsyncJob({self.id!r})"

    async def events(self, timeout: Optional[float] = None, start: str = "0-0"
                     ) -> AsyncIterator[Any]:
        r, key = self.client.redis, self.client.keys.events(self.id)
        deadline = None if timeout is None else time.monotonic() + timeout
        last, delays = start, backoff()
        while True:
            _check_cancelled()
            try:
                resp = await r.xread({key: last}, count=READ_COUNT, block=block_ms(deadline))
                delays = backoff()
            except _RETRY:
                resp = None
                await asyncio.sleep(next(delays))
            for entry_id, ev in events_in(resp):
                last = entry_id
                yield ev
                if ev.type in TERMINAL:
                    return
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job {self.id}: no final event within {timeout} s")

    async def stream(self, timeout: Optional[float] = None) -> AsyncIterator[Any]:
        replay = Replay()
        async for raw in self.events(timeout):
            for ev in replay.feed(raw):
                if ev.type in TERMINAL:
                    self._final = JobResult.from_event(self.id, ev)
                else:
                    yield ev

    async def result(self, timeout: Optional[float] = None) -> JobResult:
        if self._final is not None:
            return self._final
        keys = self.client.keys

        async def snapshot():
            pipe = self.client.redis.pipeline(transaction=True)
            pipe.hmget(keys.job(self.id), "result", "error")
            pipe.xrevrange(keys.events(self.id), count=1)
            return await pipe.execute()

        (res, err), last = await _retrying(snapshot)
        final = terminal_from_hash(res, err) or last_terminal(last)
        if final is None:
            start = last[0][0] if last else "0-0"
            async for ev in self.events(timeout, start=start):
                if ev.type in TERMINAL:
                    final = ev
        self._final = JobResult.from_event(self.id, final)
        return self._final

    async def cancel(self) -> None:
        await self.client.cancel(self.id)

    async def info(self) -> dict:
        return await self.client.redis.hgetall(self.client.keys.job(self.id))


class AsyncClient:
    def __init__(self, url: Optional[str] = None, prefix: Optional[str] = None, *,
                 redis_client: Optional[aredis.Redis] = None, job_ttl_s: int = JOB_TTL_S):
        self.url = redis_url(url)
        self.keys = Keys(key_prefix(prefix))
        self.redis = redis_client or aredis.Redis.from_url(self.url, decode_responses=True)
        self.job_ttl_s = job_ttl_s
        self._submit = self.redis.register_script(SUBMIT_LUA)
        self._cancel = self.redis.register_script(CANCEL_LUA)

    async def close(self) -> None:
        await self.redis.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def submit(self, prompt: Optional[str] = None, **kwargs: Any) -> AsyncJob:
        req = build_request(prompt, **kwargs)
        entry = await _retrying(lambda: self._submit(
            keys=[self.keys.job(req.id), self.keys.jobs(req.lane)],
            args=submit_args(req, self.job_ttl_s)))
        return AsyncJob(self, req.id, duplicate=entry is None)

    async def submit_many(self, requests: list[dict]) -> list[AsyncJob]:
        reqs = [build_request(**dict(r)) for r in requests]
        jobs: list[AsyncJob] = []
        for i in range(0, len(reqs), PIPELINE_CHUNK):
            chunk = reqs[i:i + PIPELINE_CHUNK]

            async def run_chunk(chunk=chunk):
                pipe = self.redis.pipeline(transaction=False)
                for req in chunk:
                    await self._submit(keys=[self.keys.job(req.id), self.keys.jobs(req.lane)],
                                       args=submit_args(req, self.job_ttl_s), client=pipe)
                return await pipe.execute()

            entries = await _retrying(run_chunk)
            jobs += [AsyncJob(self, q.id, duplicate=e is None) for q, e in zip(chunk, entries)]
        return jobs

    def job(self, job_id: str) -> AsyncJob:
        return AsyncJob(self, job_id)

    async def cancel(self, job_id: str) -> None:
        await _retrying(lambda: self._cancel(keys=[self.keys.job(job_id), self.keys.control],
                                             args=cancel_args(job_id, self.job_ttl_s)))
