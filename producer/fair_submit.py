"""Where a job is enqueued (issue 31's fair pull): the default tenant's on its lane stream, as
always; any other tenant's on its own sub-stream of that lane, which joins the lane's fair ring
(schemas/tenants.py; SUBMIT_LUA and FAIR_ENQUEUE_LUA do it atomically, in the lane's slot)."""
from __future__ import annotations

from genpool.schemas import Keys
from genpool.schemas.keys import GROUP
from genpool.schemas.request import JobRequest
from genpool.schemas.scripting import Script
from genpool.schemas.tenant_scripts import FAIR_ENQUEUE_LUA
from genpool.schemas.tenants import DEFAULT_TENANT, FAIR_STATE_TTL_S, TenantKeys, sub_stream

from .quotas import estimate_tokens

FAIR_ENQUEUE = Script(FAIR_ENQUEUE_LUA)


def _fair(keys: Keys, req: JobRequest) -> tuple[str, list[str]]:
    lane = keys.submit_stream(req.id, req.lane)
    return sub_stream(lane, req.tenant), TenantKeys(keys).fair(lane)[:3]


def submit_keys(keys: Keys, req: JobRequest) -> list[str]:
    """SUBMIT_LUA's keys for `req` (its arguments: producer/protocol.py submit_args)."""
    if req.tenant == DEFAULT_TENANT:
        return [keys.job(req.id), keys.submit_stream(req.id, req.lane)]
    stream, state = _fair(keys, req)
    return [keys.job(req.id), stream, *state]


def fair_args(req: JobRequest) -> list:
    """SUBMIT_LUA's arguments after the tenant: the cost; for a tenant's job also the group
    and the fair state's TTL."""
    if req.tenant == DEFAULT_TENANT:
        return [estimate_tokens(req)]
    return [estimate_tokens(req), GROUP, FAIR_STATE_TTL_S]


def queue_enqueue(pipe, keys: Keys, req: JobRequest) -> None:
    """Step 2 of a Cluster submit (the XADD) for `req`, on `pipe`."""
    if req.tenant == DEFAULT_TENANT:
        pipe.xadd(keys.submit_stream(req.id, req.lane), {"job": req.to_wire(),
                                                          "cost": estimate_tokens(req)})
        return
    stream, state = _fair(keys, req)
    FAIR_ENQUEUE.queue(pipe, [stream, *state], [req.to_wire(), req.tenant, estimate_tokens(req),
                                                GROUP, FAIR_STATE_TTL_S])
