"""A job by id through the gateway (a genpool extension, not OpenAI's): its state and result,
its event stream, and cancelling it, each only for the caller's own tenant.

  GET  /v1/jobs/{id}         the job hash's state and, once it ended, its result or error
  GET  /v1/jobs/{id}/events  the job's event stream from the start, as server-sent events, to
                             its terminal event (a late reader replays everything)
  POST /v1/jobs/{id}/cancel  ask the job to stop; answers its state

A caller with a stored key (`genpool keys`, gateway `--stored-keys`) sees only its tenant's jobs:
another tenant's job answers 404 exactly as an unknown id does, so no caller learns that an id
is in use elsewhere (producer/job_access.py gives `genpool job --api-key` the same rule). A
caller without a stored key (no keys checked, or a `--api-key` key) is the pool's operator.
"""
from __future__ import annotations

import json
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from genpool.schemas.keys import JOB_ID_RE
from genpool.schemas.tenants import DEFAULT_TENANT

from .gateway_io import ClientGone, ClosingStream, iterate_until_disconnect, sse
from .openai_format import APIError
from .tenancy import Principal

SHOWN = ("state", "lane", "tenant", "attempts", "worker", "submitted_at", "started_at",
         "finished_at")


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _not_found(job_id: str) -> APIError:
    return APIError(404, f"No job with id '{job_id}'", param="job_id", code="job_not_found")


async def _visible(gw, principal: Principal, job_id: str) -> dict:
    """The job hash, when `principal` may see it; else 404 (unknown and foreign alike)."""
    if not JOB_ID_RE.fullmatch(job_id):
        raise _not_found(job_id)
    raw = await gw.client.redis.hgetall(gw.keys.job(job_id))
    info = {_text(k): _text(v) for k, v in raw.items()}
    if not info or (principal.key is not None
                    and info.get("tenant", DEFAULT_TENANT) != principal.tenant):
        raise _not_found(job_id)
    return info


def job_body(job_id: str, info: dict) -> dict:
    body: dict[str, Any] = {"id": job_id, "object": "genpool.job"}
    body.update({k: info.get(k) for k in SHOWN})
    body["tenant"] = body["tenant"] or DEFAULT_TENANT
    for name in ("result", "error"):  # JSON of the terminal event, once the job ended
        body[name] = json.loads(info[name]) if info.get(name) else None
    return body


async def _events(request: Request, gw, job_id: str) -> AsyncIterator[str]:
    try:
        async for ev in iterate_until_disconnect(request, gw.client.job(job_id).events()):
            yield sse(ev.model_dump(mode="json", exclude_none=True))
        yield "data: [DONE]\n\n"
    except ClientGone:
        pass


def install_job_routes(app: FastAPI, gw) -> None:
    @app.get("/v1/jobs/{job_id}")
    async def get_job(job_id: str, request: Request):
        info = await _visible(gw, await gw.authorize(request), job_id)
        return JSONResponse(job_body(job_id, info))

    @app.get("/v1/jobs/{job_id}/events")
    async def job_events(job_id: str, request: Request):
        await _visible(gw, await gw.authorize(request), job_id)
        # counted as a completion's stream is: each holds a Redis connection in XREAD BLOCK
        release = gw.open.enter(gw.caller(request))
        return ClosingStream(_events(request, gw, job_id), release, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})

    @app.post("/v1/jobs/{job_id}/cancel")
    async def cancel_job(job_id: str, request: Request):
        info = await _visible(gw, await gw.authorize(request), job_id)
        await gw.client.cancel(job_id)
        # The hash read for the check is the answer: a cancel writes only `cancel`/`cancel_at`
        # (schemas/scripts.py), which job_body does not show; the owner ends the job later.
        return JSONResponse(job_body(job_id, info))
