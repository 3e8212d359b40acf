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

from genpool.schemas import Keys, ResultEvent
from genpool.schemas.tenants import USAGE_BUCKET_S, USAGE_TTL_S, TenantKeys
from genpool.workers.job import Job
from genpool.workers.lease import FENCE


@dataclass(frozen=True)
class UsageCount:
    tenant: str
    prompt: int
    completion: int
    hour: int  # epoch seconds // USAGE_BUCKET_S, when the result was made

    @classmethod
    def of(cls, job: Job, ev: ResultEvent) -> Optional["UsageCount"]:
        if job.req is None:
            return None
        return cls(job.req.tenant, ev.usage.prompt_tokens, ev.usage.completion_tokens,
                   int(time.time()) // USAGE_BUCKET_S)

    def bucket(self, keys: Keys) -> str:
        return TenantKeys(keys).usage(self.hour)


def queue_final(pipe, keys: Keys, job_id: str, token: str, head: list, events: list,
                usage: UsageCount) -> None:
    """FENCE_LUA's final write with the usage counted in it (one server / Sentinel)."""
    FENCE.queue(pipe, [keys.job(job_id), keys.events(job_id), usage.bucket(keys)],
                [token, "final+usage", *head, usage.tenant, usage.prompt, usage.completion,
                 USAGE_TTL_S, *events])


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
