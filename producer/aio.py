"""asyncio producer: the same API as genpool.producer.client, on redis.asyncio.

Commands are pipelined rather than gathered: redis.asyncio's pool holds 100 connections and
gathering more concurrent commands raises MaxConnectionsError (and is slower anyway).
"""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Optional

import redis.asyncio as aredis

from genpool.schemas import TERMINAL, JobResult, Keys
from genpool.schemas.config import key_prefix, redis_url
from genpool.schemas.connection import backoff, connect_async, is_cluster, stored_shards, xread_one
from genpool.schemas.scripting import apipelined
from genpool.schemas.tenants import check_tenant
from genpool.schemas.workers import WorkerInfo

from . import openai_tools
from .client import CANCEL, CANCEL_FLAG, PIPELINE_CHUNK, SUBMIT, SUBMIT_JOB, SUBMIT_UNDO, added, lane_refused
from .fair_submit import queue_enqueue, submit_keys
from .job import cancelled_result, raise_if_failed, replayed_result
from .liveness import live_workers_async, serving
from .protocol import (
    CONTROL_MAXLEN,
    JOB_TTL_S,
    READ_BLOCK_MS,
    READ_COUNT,
    build_request,
    cancel_args,
    cancel_broadcast,
    last_terminal,
    submit_args,
    terminal_from_hash,
)
from .quotas import ProducerQuota
from .replay import Gaps, Replay, read_events
from .retry import RETRY
from .waiting import RECONNECT_S, Watch, final_result


async def _cancellable(aw):
    """Await `aw` in a task of its own behind a shield, so that a cancel of the caller always
    raises here, at once, even when redis-py would have swallowed it inside its command (then
    the inner command is cancelled too and its outcome dropped; an XREAD ends within its
    BLOCK anyway). Seen without it: under CI load two cancels in a row left a reader waiting
    more than a second."""
    inner = asyncio.ensure_future(aw)
    inner.add_done_callback(lambda t: t.cancelled() or t.exception())
    try:
        return await asyncio.shield(inner)
    except asyncio.CancelledError:
        inner.cancel()
        raise


async def _bounded(coro, watch: Watch):
    """`coro` (one Redis call), given up with TimeoutError past the wait's deadline: a stalled
    Redis would otherwise hold it for the whole socket timeout (the connection is dropped)."""
    return await asyncio.wait_for(_cancellable(coro), watch.attempt_s())


async def _retrying(fn, attempts: int = 8):
    delays = backoff()
    for i in range(attempts):
        try:
            return await _cancellable(fn())
        except RETRY:
            if i == attempts - 1:
                raise
            await asyncio.sleep(next(delays))


class AsyncJob:
    """The asyncio twin of genpool.producer.client.Job (same errors: JobFailed, NoWorkers,
    QueueUnavailable; a cancelled job's result keeps its streamed text)."""

    def __init__(self, client: "AsyncClient", job_id: str, duplicate: bool = False,
                 model: Optional[str] = None, tools: Optional[openai_tools.Tools] = None):
        self.client, self.id, self.duplicate, self.model = client, job_id, duplicate, model
        self.tools = tools  # how to read the answer (producer/openai_tools.py)
        self._final: Optional[JobResult] = None

    def __repr__(self) -> str:
        return f"AsyncJob({self.id!r})"

    async def serving_workers(self) -> list[WorkerInfo]:
        return serving(await live_workers_async(self.client.redis, self.client.keys), self.model)

    def _watch(self, timeout: Optional[float], no_worker_s: Optional[float]) -> Watch:
        c = self.client
        return Watch(self.id, self.model, c.keys.prefix, c.url, timeout, no_worker_s,
                     c.reconnect_s)

    async def events(self, timeout: Optional[float] = None, start: str = "0-0",
                     no_worker_s: Optional[float] = None) -> AsyncIterator[Any]:
        async for ev in self._events(self._watch(timeout, no_worker_s), start):
            yield ev

    async def _events(self, watch: Watch, last: str) -> AsyncIterator[Any]:
        r, key = self.client.redis, self.client.keys.events(self.id)
        gaps = Gaps(last)  # events the stream's cap dropped before this reader got to them
        while True:
            try:
                if watch.check_due():
                    watch.saw_workers(len(await _bounded(self.serving_workers(), watch)))
                resp = await _bounded(
                    xread_one(r, key, last, READ_COUNT, watch.block_ms(READ_BLOCK_MS)), watch)
                watch.redis_ok()
            except (*RETRY, TimeoutError) as e:
                resp = None
                await asyncio.sleep(watch.retry_after(e))
            except (AttributeError, TypeError):
                # redis-py's asyncio cluster client: a connection closed under a concurrent
                # write surfaces as AttributeError/TypeError, not ConnectionError (redis-py
                # #3546; 11 of ~2,900 readers in a benchmarks/fleet_bench.py run): a lost connection
                if not self.client.cluster:
                    raise
                resp = None
                await asyncio.sleep(next(watch.delays))
            if resp:
                watch.saw_events()  # a worker writes them: serving, even while it drains
            for entry_id, ev in read_events(resp, gaps):
                last = entry_id or last
                if ev is None:  # an entry to skip (protocol.decode_event)
                    continue
                yield ev
                if ev.type in TERMINAL:
                    return
            watch.after_read()

    async def stream(self, timeout: Optional[float] = None, *, raise_on_error: bool = True,
                     no_worker_s: Optional[float] = None) -> AsyncIterator[Any]:
        replay = Replay()
        async for raw in self.events(timeout, no_worker_s=no_worker_s):
            for ev in replay.feed(raw):
                if ev.type in TERMINAL:
                    self._final = openai_tools.attach(self.tools, replayed_result(
                        self.id, ev, replay, raise_on_error=False))
                else:
                    yield ev
        if raise_on_error:
            raise_if_failed(self._final)

    async def result(self, timeout: Optional[float] = None, *, raise_on_error: bool = True,
                     no_worker_s: Optional[float] = None) -> JobResult:
        if self._final is None:
            self._final = openai_tools.attach(self.tools,
                                              await self._wait_final(timeout, no_worker_s))
        if raise_on_error:
            raise_if_failed(self._final)
        return self._final

    async def _wait_final(self, timeout: Optional[float], no_worker_s: Optional[float]
                          ) -> JobResult:
        keys, r = self.client.keys, self.client.redis

        async def snapshot():
            pipe = r.pipeline(transaction=True)
            pipe.hmget(keys.job(self.id), "result", "error")
            pipe.xrevrange(keys.events(self.id), count=1)
            return await pipe.execute()

        watch = self._watch(timeout, no_worker_s)  # one deadline for the snapshot and the wait
        while True:
            try:
                (res, err), last = await _bounded(snapshot(), watch)
                break
            except (*RETRY, TimeoutError) as e:  # a stalled Redis: never past the deadline
                await asyncio.sleep(watch.retry_after(e))
        watch.redis_ok()
        final = terminal_from_hash(res, err) or last_terminal(last)
        if final is None:
            start = last[0][0] if last else "0-0"
            async for ev in self._events(watch, start):
                if ev.type in TERMINAL:
                    final = ev
        if final.type == "error" and final.code == "cancelled":
            return cancelled_result(self.id, final, await _retrying(lambda: r.xrange(keys.events(self.id))))
        return final_result(self.id, final, raise_on_error=False)

    async def cancel(self) -> None:
        await self.client.cancel(self.id)

    async def info(self) -> dict:
        return await self.client.redis.hgetall(self.client.keys.job(self.id))


class AsyncClient:
    """`url`: any form genpool.schemas.connection accepts (one server, redis+cluster://,
    redis+sentinel://)."""

    def __init__(self, url: Optional[str] = None, prefix: Optional[str] = None, *,
                 redis_client: Optional[aredis.Redis] = None, job_ttl_s: int = JOB_TTL_S,
                 reconnect_s: float = RECONNECT_S,
                 tenant: Optional[str] = None, check_quota: bool = True):
        self.url = redis_url(url)
        self.reconnect_s = reconnect_s
        self.keys = Keys(key_prefix(prefix))
        self.redis = redis_client or connect_async(self.url, decode_responses=True)
        self.cluster = is_cluster(self.redis)  # then: no script or MULTI spans two hash slots
        self.job_ttl_s = job_ttl_s
        # the tenant of every job this client submits that names none (trusted producers only:
        # whoever holds the Redis URL may name any tenant; the gateway takes it from the key)
        self.tenant = None if tenant is None else check_tenant(tenant)
        # a named tenant's requests / tokens per minute (off in the gateway: it checks its own)
        self.quota = ProducerQuota(self.keys, check_quota)
        self._shards_known = False

    async def close(self) -> None:
        await self.redis.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def lane_keys(self) -> Keys:
        """self.keys with the lane-shard count the workers published (read once per client)."""
        if not self._shards_known:
            n = await _retrying(lambda: self.redis.hget(self.keys.meta, "lane_shards"))
            self.keys, self._shards_known = self.keys.with_shards(stored_shards(n)), True
        return self.keys

    async def submit(self, prompt: Optional[str] = None, **kwargs: Any) -> AsyncJob:
        tools = openai_tools.prepare(kwargs)  # as the sync Client's submit
        req = build_request(prompt, **{"tenant": self.tenant, **kwargs})
        await self.quota.acheck(self.redis, req)  # RateLimited when over
        keys = await self.lane_keys()
        if self.cluster:
            (entry,) = await _retrying(lambda: self._enqueue_cluster([req], keys))
        else:
            entry = await _retrying(lambda: SUBMIT.acall(
                self.redis, submit_keys(keys, req), submit_args(req, self.job_ttl_s)))
        return AsyncJob(self, req.id, duplicate=entry is None, model=req.model, tools=tools)

    async def submit_many(self, requests: list[dict]) -> list[AsyncJob]:
        requests = [dict(r) for r in requests]
        tools = [openai_tools.prepare(r) for r in requests]  # as in submit
        reqs = [build_request(**{"tenant": self.tenant, **dict(r)}) for r in requests]
        for req in reqs:
            await self.quota.acheck(self.redis, req)
        keys = await self.lane_keys()
        send = self._enqueue_cluster if self.cluster else self._submit_chunk
        jobs: list[AsyncJob] = []
        for i in range(0, len(reqs), PIPELINE_CHUNK):
            chunk = reqs[i:i + PIPELINE_CHUNK]
            entries = await _retrying(lambda chunk=chunk: send(chunk, keys))
            jobs += [AsyncJob(self, q.id, duplicate=e is None, model=q.model, tools=t)
                     for q, e, t in zip(chunk, entries, tools[i:i + PIPELINE_CHUNK])]
        return jobs

    async def _submit_chunk(self, chunk: list, keys: Keys) -> list:
        return await apipelined(self.redis, chunk, lambda pipe, req: SUBMIT.queue(
            pipe, submit_keys(keys, req), submit_args(req, self.job_ttl_s)), [SUBMIT], raise_errors=True)

    async def _enqueue_cluster(self, chunk: list, keys: Keys) -> list:
        """The sync Client's _enqueue_cluster: three one-slot steps, pipelined."""
        now = submit_args(chunk[0], self.job_ttl_s)[2]
        claimed = await apipelined(self.redis, chunk, lambda pipe, req: SUBMIT_JOB.queue(
            pipe, [keys.job(req.id)], [req.lane, now, self.job_ttl_s, req.tenant]), [SUBMIT_JOB],
            raise_errors=True)
        fresh = [req for req, ok in zip(chunk, claimed) if ok]
        pipe = self.redis.pipeline(transaction=False)
        for req in fresh:
            queue_enqueue(pipe, keys, req)  # an XADD (a tenant's: on its sub-stream)
        replies = await pipe.execute(raise_on_error=False) if fresh else []
        entries, refused = added(fresh, replies)
        pipe = self.redis.pipeline(transaction=False)
        for job_id, entry in entries.items():
            pipe.hsetnx(keys.job(job_id), "entry", entry)
        for req, _ in refused:  # nothing may stay behind for an id whose XADD was refused
            SUBMIT_UNDO.queue(pipe, [keys.job(req.id)], [now])  # EVAL here: never NoScriptError
        if entries or refused:
            await pipe.execute()
        if refused:
            req, err = refused[0]
            raise lane_refused(keys.submit_stream(req.id, req.lane), err)
        return [entries.get(req.id) for req in chunk]

    def job(self, job_id: str, model: Optional[str] = None) -> AsyncJob:
        return AsyncJob(self, job_id, model=model)

    async def cancel(self, job_id: str) -> None:
        if self.cluster:  # two slots: the flag first, then the broadcast (see CANCEL_FLAG_LUA)
            await _retrying(lambda: CANCEL_FLAG.acall(self.redis, [self.keys.job(job_id)],
                                                      cancel_args(job_id, self.job_ttl_s)))
            await _retrying(lambda: self.redis.xadd(self.keys.control, cancel_broadcast(job_id),
                                                    maxlen=CONTROL_MAXLEN, approximate=True))
            return
        await _retrying(lambda: CANCEL.acall(self.redis, [self.keys.job(job_id), self.keys.control],
                                             cancel_args(job_id, self.job_ttl_s)))
