"""Usage per tenant, counted once, with the job's result (issue 31).

On one server or behind Sentinel the count rides in the result's fenced write (FENCE_LUA's
`final+usage`: KEYS[3] is the hour's usage hash), so it lands exactly when the result does: a
resend of a write that landed is refused by the fence, and a rerun or resume writes one result.
On a Redis Cluster the usage hash is in another slot than the job, so no one script may touch
both; there it is counted right after the result landed, in the next round trip: never twice,
but a worker that dies between the two loses that job's count (docs/protocol.md, "Tenants").
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import redis

from genpool.schemas import Keys, ResultEvent
from genpool.schemas.keys import field_int
from genpool.schemas.scripting import Script, pipelined
from genpool.schemas.tenant_scripts import FAIR_SETTLE_LUA
from genpool.schemas.tenants import (
    DEFAULT_TENANT,
    FAIR_STATE_TTL_S,
    SUB_STREAM_SEP,
    USAGE_BUCKET_S,
    USAGE_TTL_S,
    TenantKeys,
)
from genpool.workers.job import Job
from genpool.workers.lease import FENCE

FAIR_SETTLE = Script(FAIR_SETTLE_LUA)


@dataclass(frozen=True)
class UsageCount:
    tenant: str
    prompt: int
    completion: int
    hour: int  # epoch seconds // USAGE_BUCKET_S, when the result was made
    stream: str = ""  # the lane stream or sub-stream its entry was read from
    charged: Optional[int] = None  # what fair pull charged for it (the entry's `cost`)

    @classmethod
    def of(cls, job: Job, ev: ResultEvent) -> Optional["UsageCount"]:
        if job.req is None:
            return None
        cost = job.entry.fields.get(b"cost", job.entry.fields.get("cost"))
        charged = field_int(cost)  # a producer wrote it: anything may be there
        return cls(job.req.tenant, ev.usage.prompt_tokens, ev.usage.completion_tokens,
                   int(time.time()) // USAGE_BUCKET_S, job.entry.stream, charged)

    def bucket(self, keys: Keys) -> str:
        return TenantKeys(keys).usage(self.hour)


def queue_final(pipe, keys: Keys, job_id: str, token: str, head: list, events: list,
                usage: UsageCount) -> None:
    """FENCE_LUA's final write with the usage counted in it (one server / Sentinel)."""
    FENCE.queue(pipe, [keys.job(job_id), keys.events(job_id), usage.bucket(keys)],
                [token, "final+usage", *head, usage.tenant, usage.prompt, usage.completion,
                 USAGE_TTL_S, *events])


def settle_after(r, keys: Keys, counts: list[UsageCount]) -> None:
    """Give each landed result's tenant back what fair pull over-charged it (FAIR_SETTLE_LUA),
    in one pipeline; a failure only leaves the estimate standing."""
    t = TenantKeys(keys)
    calls = []
    for u in counts:
        if u.charged is None:
            continue
        sub = SUB_STREAM_SEP + u.tenant
        lane, member = ((u.stream[:-len(sub)], u.tenant) if u.stream.endswith(sub)
                        else (u.stream, DEFAULT_TENANT))
        ring, active, _, deficit = t.fair(lane)
        calls.append(([deficit, active, ring],
                      [member, u.charged - u.prompt - u.completion, FAIR_STATE_TTL_S]))
    if not calls:
        return
    try:
        pipelined(r, calls, lambda pipe, c: FAIR_SETTLE.queue(pipe, *c), [FAIR_SETTLE])
    except redis.RedisError:  # the results and acks are in: fairness keeps the estimates
        pass


def count_after(r, keys: Keys, counts: list[UsageCount]) -> None:
    """A Redis Cluster's count, after the results landed (one pipeline; a failure loses the
    counts, never doubles them)."""
    pipe = r.pipeline(transaction=False)
    for u in counts:
        key = u.bucket(keys)
        pipe.hincrby(key, f"{u.tenant}:prompt", u.prompt)
        pipe.hincrby(key, f"{u.tenant}:completion", u.completion)
        pipe.hincrby(key, f"{u.tenant}:jobs", 1)
        pipe.expire(key, USAGE_TTL_S)
    pipe.execute(raise_on_error=False)
