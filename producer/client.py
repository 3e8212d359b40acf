"""Synchronous producer: submit jobs, stream their tokens, wait for results, cancel.

The Client submits and cancels; a job's reads (events, stream, result) are its Job handle's
(producer/job.py, re-exported here).
"""
from __future__ import annotations

from typing import Any, Optional

import redis

from genpool.schemas import Keys
from genpool.schemas.config import key_prefix, redis_url
from genpool.schemas.connection import REDIS_DOWN, connect, is_cluster, stored_shards
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

from . import openai_tools
from .fair_submit import queue_enqueue, submit_keys
from .job import Job
from .protocol import (
    CONTROL_MAXLEN,
    JOB_TTL_S,
    build_request,
    cancel_args,
    cancel_broadcast,
    submit_args,
)
from .quotas import ProducerQuota
from .retry import retrying
from .waiting import RECONNECT_S

PIPELINE_CHUNK = 500
# The producer's scripts (schemas/scripts.py), shared by the sync and asyncio clients and by
# producer/dead.py; each loads itself where a server lacks it (schemas/scripting.py).
SUBMIT, SUBMIT_JOB, SUBMIT_UNDO = Script(SUBMIT_LUA), Script(SUBMIT_JOB_LUA), Script(SUBMIT_UNDO_LUA)
CANCEL, CANCEL_FLAG = Script(CANCEL_LUA), Script(CANCEL_FLAG_LUA)


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
            n = retrying(lambda: self.redis.hget(self.keys.meta, "lane_shards"))
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
            (entry,) = retrying(lambda: self._enqueue_cluster([req]))
        else:
            entry = retrying(lambda: SUBMIT(
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
            entries = retrying(lambda chunk=chunk: send(chunk))
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
            retrying(lambda: CANCEL_FLAG(self.redis, [self.keys.job(job_id)],
                                          cancel_args(job_id, self.job_ttl_s)))
            retrying(lambda: self.redis.xadd(self.keys.control, cancel_broadcast(job_id),
                                              maxlen=CONTROL_MAXLEN, approximate=True))
            return
        retrying(lambda: CANCEL(self.redis, [self.keys.job(job_id), self.keys.control],
                                 cancel_args(job_id, self.job_ttl_s)))

    @property
    def raw(self):
        """A client on the same connection settings that does not decode replies: for reads of
        what anyone may have written (dead letters, status), decoded leniently by the reader."""
        if self._raw is None:
            self._raw = self._raw_client()
        return self._raw

    def status(self) -> dict:
        from .status import queue_status

        return queue_status(self.raw, self.lane_keys())  # status must never choke on junk

    def _raw_client(self):
        if self.own_client or not hasattr(self.redis, "connection_pool"):
            return connect(self.url, decode_responses=False)
        pool = self.redis.connection_pool  # the caller's connection settings (TLS, auth, ...)
        kwargs = {**pool.connection_kwargs, "decode_responses": False}
        return redis.Redis(connection_pool=redis.ConnectionPool(
            connection_class=pool.connection_class, **kwargs))
