"""A tenant's cap on queued jobs (TenantLimits.max_queued; issue 31), checked at submit.

Each submit of a capped tenant adds its job id to the tenant's sorted set (schemas/tenants.py
`queued`), then counts it. Over the cap, the set is pruned first: an id whose job hash says it
left the queue (running, finished, cancelled, or gone) is dropped, so a job that a worker took,
or that died with its worker, frees its place without any worker writing here. Still over:
the new id is taken out again and the submit refused. Adding before counting means two racing
submits can both be refused at the edge, never both admitted past it.
"""
from __future__ import annotations

import time

from genpool.schemas import Keys
from genpool.schemas.keys import JOB_TTL_S
from genpool.schemas.tenants import TenantKeys

# A job id added this recently may not have its hash yet (its submit is under way): keep it.
GRACE_S = 30.0


class QueueCapReached(Exception):
    """A tenant's submit was refused: it has `cap` jobs waiting already (max_queued)."""

    def __init__(self, tenant: str, cap: int):
        super().__init__(f"tenant {tenant!r} has {cap} jobs waiting, its limit (max_queued "
                         f"{cap}); retry once some have started")
        self.tenant, self.cap, self.limit = tenant, cap, "queued"


def _still_queued(fields: list, added: float, now: float) -> bool:
    state, cancel = fields
    if state is None:
        return now - added < GRACE_S
    return state == "queued" and cancel != "1"


def _gone(members: list, states: list, now: float) -> list[str]:
    return [job_id for (job_id, added), fields in zip(members, states)
            if not _still_queued(fields, added, now)]


def _add(pipe, key: str, job_id: str, now: float) -> None:
    pipe.zadd(key, {job_id: now})
    pipe.expire(key, JOB_TTL_S)
    pipe.zcard(key)


class QueuedCap:
    def __init__(self, keys: Keys):
        self.keys, self.t = keys, TenantKeys(keys)

    def enter(self, r, tenant: str, job_id: str, cap: int) -> None:
        """Count `job_id` against `tenant`'s cap (a synchronous client); QueueCapReached."""
        key, now = self.t.queued(tenant), time.time()
        pipe = r.pipeline(transaction=True)
        _add(pipe, key, job_id, now)
        if pipe.execute()[-1] <= cap:
            return
        members = r.zrange(key, 0, -1, withscores=True)
        pipe = r.pipeline(transaction=False)
        for job_id_, _ in members:
            pipe.hmget(self.keys.job(job_id_), "state", "cancel")
        gone = _gone(members, pipe.execute(), now)
        if gone:
            r.zrem(key, *gone)
        if r.zcard(key) > cap:
            r.zrem(key, job_id)
            raise QueueCapReached(tenant, cap)

    async def aenter(self, r, tenant: str, job_id: str, cap: int) -> None:
        """enter() on an asyncio client."""
        key, now = self.t.queued(tenant), time.time()
        pipe = r.pipeline(transaction=True)
        _add(pipe, key, job_id, now)
        if (await pipe.execute())[-1] <= cap:
            return
        members = await r.zrange(key, 0, -1, withscores=True)
        pipe = r.pipeline(transaction=False)
        for job_id_, _ in members:
            pipe.hmget(self.keys.job(job_id_), "state", "cancel")
        gone = _gone(members, await pipe.execute(), now)
        if gone:
            await r.zrem(key, *gone)
        if await r.zcard(key) > cap:
            await r.zrem(key, job_id)
            raise QueueCapReached(tenant, cap)
