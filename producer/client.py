"""Synchronous producer: submit jobs, stream their tokens, wait for results, cancel."""
from __future__ import annotations

import time
from typing import Any, Iterator, Optional

import redis

from genpool.schemas import (
    TERMINAL,
    JobResult,
    Keys,
    RestartEvent,
    RewindEvent,
    TokenEvent,
    TrimmedEvent,
)
from genpool.schemas.config import key_prefix, redis_url
from genpool.schemas.connection import REDIS_DOWN, backoff, connect, is_cluster, stored_shards, xread_one
from genpool.schemas.scripting import Script, pipelined
from genpool.schemas.scripts import (
    CANCEL_FLAG_LUA,
    CANCEL_LUA,
    LANE_REFUSED,
    SUBMIT_JOB_LUA,
    SUBMIT_LUA,
    SUBMIT_UNDO_LUA,
)
from genpool.schemas.tenants import check_tenant
from genpool.schemas.workers import WorkerInfo

from . import openai_tools
from .errors import JobFailed
from .fair_submit import queue_enqueue, submit_keys
from .liveness import live_workers, serving
from .protocol import (
    CONTROL_MAXLEN,
    JOB_TTL_S,
    READ_BLOCK_MS,
    READ_COUNT,
    build_request,
    cancel_args,
    cancel_broadcast,
    events_in,
    last_terminal,
    submit_args,
    terminal_from_hash,
)
from .quotas import ProducerQuota
from .replay import Gaps, Replay, read_events
from .waiting import RECONNECT_S, Watch, final_result

PIPELINE_CHUNK = 500
# The producer's scripts (schemas/scripts.py), shared by the sync and asyncio clients and by
# producer/dead.py; each loads itself where a server lacks it (schemas/scripting.py).
SUBMIT, SUBMIT_JOB, SUBMIT_UNDO = Script(SUBMIT_LUA), Script(SUBMIT_JOB_LUA), Script(SUBMIT_UNDO_LUA)
CANCEL, CANCEL_FLAG = Script(CANCEL_LUA), Script(CANCEL_FLAG_LUA)
# (a cluster's MOVED after a resharding: the next try goes to the key's new node)
_RETRY = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterDownError,
          redis.exceptions.TryAgainError, redis.exceptions.MovedError)


class Job:
    """Handle on one submitted job. `duplicate` is True when the id already existed.

    `result()` raises JobFailed when the job failed (`raise_on_error=False` returns the JobResult
    with `.error` instead); a cancelled job's result keeps the text streamed before the cancel,
    with finish_reason "cancelled". Waits raise NoWorkers (a TimeoutError) when they end while no
    live worker serves the job's model, and QueueUnavailable when Redis stays away (errors.py).
    A job submitted with `tools` has its results' `tool_calls` and `content` filled in."""

    def __init__(self, client: "Client", job_id: str, duplicate: bool = False,
                 model: Optional[str] = None, tools: Optional[openai_tools.Tools] = None):
        self.client, self.id, self.duplicate, self.model = client, job_id, duplicate, model
        self.tools = tools  # how to read the answer (producer/openai_tools.py)
        self._final: Optional[JobResult] = None

    def __repr__(self) -> str:
        return f"Job({self.id!r})"

    def _watch(self, timeout: Optional[float], no_worker_s: Optional[float]) -> Watch:
        c = self.client
        return Watch(self.id, self.model, c.keys.prefix, c.url, timeout, no_worker_s,
                     c.reconnect_s)

    def serving_workers(self) -> list[WorkerInfo]:
        """Live workers that would take this job (any model when the job names none)."""
        return serving(live_workers(self.client.redis, self.client.keys), self.model)

    def events(self, timeout: Optional[float] = None, start: str = "0-0",
               no_worker_s: Optional[float] = None) -> Iterator[Any]:
        """Raw events from `start` up to and including the terminal one (reconnects on loss),
        with a TrimmedEvent where the stream's cap dropped events before they were read."""
        r, key = self.client.redis, self.client.keys.events(self.id)
        watch, last, delays = self._watch(timeout, no_worker_s), start, backoff()
        gaps = Gaps(start)  # events the stream's cap dropped before this reader got to them
        while True:
            try:
                if watch.check_due():
                    watch.saw_workers(len(self.serving_workers()))
                resp = xread_one(r, key, last, READ_COUNT, watch.block_ms(READ_BLOCK_MS))
                watch.redis_ok()
                delays = backoff()
            except _RETRY as e:
                watch.redis_failed(e)
                resp = None
                time.sleep(next(delays))
            for entry_id, ev in read_events(resp, gaps):
                last = entry_id or last
                yield ev
                if ev.type in TERMINAL:
                    return
            watch.after_read()

    def stream(self, timeout: Optional[float] = None, *, raise_on_error: bool = True,
               no_worker_s: Optional[float] = None
               ) -> Iterator[TokenEvent | RestartEvent | RewindEvent | TrimmedEvent]:
        """Token events from the start; a RestartEvent only if a rerun diverged (see replay.py);
        a RewindEvent where a worker resumed the job from fewer tokens than this reader saw;
        a TrimmedEvent where this reader fell so far behind that the stream's cap dropped events
        unread (their text is then missing here, never from `result()`). Ends normally on a
        result or a cancel; raises JobFailed on any other error."""
        replay = Replay()
        for raw in self.events(timeout, no_worker_s=no_worker_s):
            for ev in replay.feed(raw):
                if ev.type in TERMINAL:
                    t = replay.tracks.get(0)
                    self._final = openai_tools.attach(self.tools, final_result(
                        self.id, ev, t.text if t else "", t.ids if t else [],
                        raise_on_error=False))
                else:
                    yield ev
        if raise_on_error and self._final is not None and self._final.finish_reason is None \
                and self._final.error is not None:
            raise JobFailed(self._final)

    def result(self, timeout: Optional[float] = None, *, raise_on_error: bool = True,
               no_worker_s: Optional[float] = None) -> JobResult:
        if self._final is None:
            self._final = openai_tools.attach(self.tools, self._wait_final(timeout, no_worker_s))
        if raise_on_error and self._final.error is not None and self._final.finish_reason is None:
            raise JobFailed(self._final)
        return self._final

    def _wait_final(self, timeout: Optional[float], no_worker_s: Optional[float]) -> JobResult:
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
            final = next(ev for ev in self.events(timeout, start=start, no_worker_s=no_worker_s)
                         if ev.type in TERMINAL)
        if final.type == "error" and final.code == "cancelled":
            return self._cancelled(final)
        return final_result(self.id, final, raise_on_error=False)

    def _cancelled(self, final) -> JobResult:
        """A cancelled job's result: the text its stream carried before the cancel."""
        replay = Replay()
        raw = _retrying(lambda: self.client.redis.xrange(self.client.keys.events(self.id)))
        for _, ev in events_in([(None, raw)]):
            replay.feed(ev)
        t = replay.tracks.get(0)
        return final_result(self.id, final, t.text if t else "", t.ids if t else [])

    def cancel(self) -> None:
        self.client.cancel(self.id)

    def info(self) -> dict:
        return self.client.redis.hgetall(self.client.keys.job(self.id))


def added(fresh: list, replies: list) -> tuple[dict, list]:
    """A Cluster submit's XADD replies: ({job id: entry id}, [(request, error)] refused). A
    lost connection is raised (the XADD may have landed: the retried submit completes it)."""
    entries, refused = {}, []
    for req, reply in zip(fresh, replies):
        if isinstance(reply, REDIS_DOWN):
            raise reply
        if isinstance(reply, Exception):
            refused.append((req, reply))
        else:
            entries[req.id] = reply
    return entries, refused


def lane_refused(stream: str, err: Exception) -> redis.ResponseError:
    """What a Cluster submit raises when its lane refused the XADD (SUBMIT_LUA's words)."""
    return redis.ResponseError(f"lane stream {stream} refused the job: {err} ({LANE_REFUSED})")


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
    """`url`: any form genpool.schemas.connection accepts (one server, redis+cluster://,
    redis+sentinel://)."""

    def __init__(self, url: Optional[str] = None, prefix: Optional[str] = None, *,
                 redis_client: Optional[redis.Redis] = None, job_ttl_s: int = JOB_TTL_S,
                 reconnect_s: float = RECONNECT_S,
                 tenant: Optional[str] = None, check_quota: bool = True):
        self.url = redis_url(url)
        self.reconnect_s = reconnect_s  # how long a waiting reader retries a lost Redis
        self.keys = Keys(key_prefix(prefix))
        self.redis = redis_client or connect(self.url, decode_responses=True)
        self.own_client = redis_client is None
        self.cluster = is_cluster(self.redis)  # then: no script or MULTI spans two hash slots
        self.job_ttl_s = job_ttl_s
        # the tenant of every job this client submits that names none (trusted producers only:
        # whoever holds the Redis URL may name any tenant; the gateway takes it from the key)
        self.tenant = None if tenant is None else check_tenant(tenant)
        # a named tenant's requests / tokens per minute (off in the gateway: it checks its own)
        self.quota = ProducerQuota(self.keys, check_quota)
        self._shards_known = False
        self._raw = None

    def close(self) -> None:
        self.redis.close()
        if self._raw is not None:
            self._raw.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def lane_keys(self) -> Keys:
        """self.keys with the lane-shard count the workers published (read once per client:
        a client that missed a later increase still enqueues on shards workers read)."""
        if not self._shards_known:
            n = _retrying(lambda: self.redis.hget(self.keys.meta, "lane_shards"))
            self.keys, self._shards_known = self.keys.with_shards(stored_shards(n)), True
        return self.keys

    def submit(self, prompt: Optional[str] = None, **kwargs: Any) -> Job:
        """kwargs: messages, model, priority, job_id, deadline, metadata, and SamplingParams
        names; OpenAI's tools, tool_choice and parallel_tool_calls with messages."""
        tools = openai_tools.prepare(kwargs)  # a plain chat job, and how to read its answer
        req = build_request(prompt, **{"tenant": self.tenant, **kwargs})
        self.quota.check(self.redis, req)  # RateLimited when over
        keys = self.lane_keys()
        if self.cluster:
            (entry,) = _retrying(lambda: self._enqueue_cluster([req]))
        else:
            entry = _retrying(lambda: SUBMIT(
                self.redis, submit_keys(keys, req), submit_args(req, self.job_ttl_s)))
        return Job(self, req.id, duplicate=entry is None, model=req.model, tools=tools)

    def submit_many(self, requests: list[dict]) -> list[Job]:
        """Validate all, then enqueue in pipelined chunks (one round trip per chunk)."""
        requests = [dict(r) for r in requests]
        tools = [openai_tools.prepare(r) for r in requests]  # as in submit
        reqs = [build_request(**{"tenant": self.tenant, **dict(r)}) for r in requests]
        for req in reqs:
            self.quota.check(self.redis, req)
        self.lane_keys()
        send = self._enqueue_cluster if self.cluster else self._submit_chunk
        jobs: list[Job] = []
        for i in range(0, len(reqs), PIPELINE_CHUNK):
            chunk = reqs[i:i + PIPELINE_CHUNK]
            entries = _retrying(lambda chunk=chunk: send(chunk))
            jobs += [Job(self, q.id, duplicate=e is None, model=q.model, tools=t)
                     for q, e, t in zip(chunk, entries, tools[i:i + PIPELINE_CHUNK])]
        return jobs

    def map(self, items, concurrency: int = 16, **common):
        """Run every item (prompt string or dict of submit kwargs), `concurrency` jobs at most in
        flight; JobResults in input order; timeout=, no_worker_s= as in Job.result (map_prompts)."""
        from genpool.producer.pipeline import map_prompts

        return map_prompts(self, items, concurrency=concurrency, **common)

    def _submit_chunk(self, chunk: list) -> list:
        # Retrying is safe: the script skips ids that already exist (a chunk that half-landed
        # before a connection loss reports those as duplicates, and runs each job once).
        keys = self.keys
        return pipelined(self.redis, chunk, lambda pipe, req: SUBMIT.queue(
            pipe, submit_keys(keys, req), submit_args(req, self.job_ttl_s)), [SUBMIT], raise_errors=True)

    def _enqueue_cluster(self, chunk: list) -> list:
        """SUBMIT_JOB_LUA, XADD, HSETNX entry: three pipelined round trips, each command within
        one hash slot (producer/protocol.py says why this order is safe to retry)."""
        now, keys = submit_args(chunk[0], self.job_ttl_s)[2], self.keys
        claimed = pipelined(self.redis, chunk, lambda pipe, req: SUBMIT_JOB.queue(
            pipe, [keys.job(req.id)], [req.lane, now, self.job_ttl_s, req.tenant]), [SUBMIT_JOB],
            raise_errors=True)
        fresh = [req for req, ok in zip(chunk, claimed) if ok]
        pipe = self.redis.pipeline(transaction=False)
        for req in fresh:
            queue_enqueue(pipe, keys, req)  # an XADD (a tenant's: on its sub-stream)
        entries, refused = added(fresh, pipe.execute(raise_on_error=False) if fresh else [])
        pipe = self.redis.pipeline(transaction=False)
        for job_id, entry in entries.items():
            pipe.hsetnx(keys.job(job_id), "entry", entry)
        for req, _ in refused:  # nothing may stay behind for an id whose XADD was refused
            SUBMIT_UNDO.queue(pipe, [keys.job(req.id)], [now])  # EVAL here: never NoScriptError
        if entries or refused:
            pipe.execute()
        if refused:
            req, err = refused[0]
            raise lane_refused(keys.submit_stream(req.id, req.lane), err)
        return [entries.get(req.id) for req in chunk]

    def job(self, job_id: str, model: Optional[str] = None) -> Job:
        return Job(self, job_id, model=model)

    def cancel(self, job_id: str) -> None:
        # The flag stops a job no worker has started; the control entry reaches the one running it.
        if self.cluster:  # two slots: the flag first, then the broadcast (see CANCEL_FLAG_LUA)
            _retrying(lambda: CANCEL_FLAG(self.redis, [self.keys.job(job_id)],
                                          cancel_args(job_id, self.job_ttl_s)))
            _retrying(lambda: self.redis.xadd(self.keys.control, cancel_broadcast(job_id),
                                              maxlen=CONTROL_MAXLEN, approximate=True))
            return
        _retrying(lambda: CANCEL(self.redis, [self.keys.job(job_id), self.keys.control],
                                 cancel_args(job_id, self.job_ttl_s)))

    def status(self) -> dict:
        from .status import queue_status

        if self._raw is None:  # bytes in, decoded leniently: status must never choke on junk
            self._raw = self._raw_client()
        return queue_status(self._raw, self.lane_keys())

    def _raw_client(self):
        if self.own_client or not hasattr(self.redis, "connection_pool"):
            return connect(self.url, decode_responses=False)
        pool = self.redis.connection_pool  # the caller's connection settings (TLS, auth, ...)
        kwargs = {**pool.connection_kwargs, "decode_responses": False}
        return redis.Redis(connection_pool=redis.ConnectionPool(
            connection_class=pool.connection_class, **kwargs))
