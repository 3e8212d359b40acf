"""OpenAI's Batch API on the gateway (`/v1/batches`: create, retrieve, list, cancel) and the
gateway's part in it: the stores and the background driver (producer/batch_driver.py).

Any gateway answers for any batch (the records are in Redis), and each runs a driver: the one
that holds a batch's lease expands and collects it, another takes over if it dies.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from fastapi import FastAPI, Request

from genpool.schemas.batches import (
    BATCH_IN_FLIGHT,
    BATCH_LEASE_MS,
    BATCH_PRIORITY,
    BATCH_TICK_S,
    COMPLETION_WINDOWS,
    MAX_ACTIVE_BATCH_BYTES,
    MAX_FILE_BYTES,
    MAX_TENANT_FILE_BYTES,
    BatchRecord,
    BatchView,
)

from .batch_driver import BatchDriver
from .batch_store import BatchStore, FileStore
from .batch_webhooks import WebhookOptions
from .gateway_io import read_json
from .openai_files import install_file_routes, list_args, listing, storage_lock, visible
from .openai_format import ENDPOINTS, APIError, one_of
from .tenancy import Principal

MAX_METADATA = (16, 64, 512)  # OpenAI's bounds: keys, key length, value length


@dataclass
class BatchOptions:
    """window_s: how long a completion_window lasts here (None: what it says, 24 h; tests set
    seconds); drive: whether this gateway runs a driver (any number of gateways may)."""
    window_s: Optional[float] = None
    max_file_bytes: int = MAX_FILE_BYTES
    drive: bool = True
    lease_ms: int = BATCH_LEASE_MS
    tick_s: float = BATCH_TICK_S
    webhook: Optional[WebhookOptions] = None  # a signed POST when a batch ends
    in_flight: int = BATCH_IN_FLIGHT  # lines of one batch submitted and unanswered at once
    max_active_bytes: int = MAX_ACTIVE_BATCH_BYTES  # a tenant's unended batches' input, at most
    max_tenant_file_bytes: int = MAX_TENANT_FILE_BYTES  # a tenant's uploaded files, at most


class BatchAPI:
    def __init__(self, gw, options: BatchOptions):
        self.gw, self.options = gw, options
        self.max_file_bytes = options.max_file_bytes
        self.files: Optional[FileStore] = None
        self.batches: Optional[BatchStore] = None
        self.driver: Optional[BatchDriver] = None
        self._task: Optional[asyncio.Task] = None

    async def principal(self, request: Request) -> Principal:
        """401 unless the gateway accepts the request's key; who is calling."""
        return await self.gw.authorize(request)

    async def authorize(self, request: Request) -> str:
        """The caller's tenant (after principal()'s check)."""
        return (await self.principal(request)).tenant

    async def start(self) -> None:
        """After the gateway's own start (its Redis client)."""
        client = self.gw.client
        self.files = FileStore(client.redis, client.keys)
        self.batches = BatchStore(client.redis, client.keys)
        self.driver = BatchDriver(client, self.files, self.batches,
                                  lease_ms=self.options.lease_ms, tick_s=self.options.tick_s,
                                  webhook=self.options.webhook,
                                  in_flight=self.options.in_flight, checks=self.gw.checks)
        if self.options.drive:
            self._task = asyncio.ensure_future(self.driver.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self.driver is not None:
            await self.driver.close()

    async def owned(self, tenant: str, batch_id: str) -> BatchView:
        view = await self.batches.get(batch_id)
        if view is None or not visible(view.record.owner, tenant):
            raise APIError(404, f"No such Batch object: {batch_id}", param="batch_id",
                           code="not_found")
        return view

    async def create(self, request: Request, who: Principal) -> dict:
        body = await read_json(request, self.gw.idle_timeout_s)
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        endpoint, window = body.get("endpoint"), body.get("completion_window")
        if not one_of(endpoint, ENDPOINTS):
            raise APIError(400, f"endpoint must be one of {', '.join(ENDPOINTS)} (got "
                                f"{endpoint!r})", param="endpoint", code="invalid_value")
        if not one_of(window, COMPLETION_WINDOWS):
            raise APIError(400, f"completion_window must be one of {', '.join(COMPLETION_WINDOWS)}"
                                f" (got {window!r})", param="completion_window",
                           code="invalid_value")
        metadata = check_metadata(body.get("metadata"))
        fid = body.get("input_file_id")
        file = await self.files.get(fid) if isinstance(fid, str) else None
        tenant = who.tenant
        if file is None or not visible(file.owner, tenant):
            raise APIError(404, f"No such File object: {fid}", param="input_file_id",
                           code="not_found")
        if file.purpose != "batch":
            raise APIError(400, f"file {fid} has purpose {file.purpose!r}, not 'batch'",
                           param="input_file_id", code="invalid_value")
        async with storage_lock(self.batches.r, self.batches.keys, tenant):
            await self.batch_room(tenant, file.bytes)
            rec = self.record(endpoint, fid, window, metadata, who, file.bytes)
            await self.batches.create(rec, file.lines)
        if self.driver is not None:
            self.driver.wake.set()
        return (await self.batches.get(rec.id)).public()

    async def batch_room(self, tenant: str, size: int) -> None:
        held = await self.batches.active_bytes(tenant)
        if held + size > self.options.max_active_bytes:
            raise APIError(429, f"this tenant's batches not yet ended hold {held} bytes of input; "
                                f"with this file's {size} that is over the limit of "
                                f"{self.options.max_active_bytes}: wait for one to end",
                           type_="rate_limit_exceeded", code="batch_limit_exceeded")

    def record(self, endpoint: str, fid: str, window: str, metadata, who: Principal,
               size: int) -> BatchRecord:
        now = time.time()
        span = self.options.window_s or COMPLETION_WINDOWS[window]
        return BatchRecord(id=f"batch_{uuid.uuid4().hex[:24]}", endpoint=endpoint,
                           input_file_id=fid, completion_window=window, created_at=int(now),
                           expires_at=int(now + span + 0.999), metadata=metadata,
                           owner=who.tenant, model=self.gw.default_model, input_bytes=size,
                           **key_rules(who))


def key_rules(who: Principal) -> dict:
    """What the caller's stored key allows the batch's lines (producer/tenancy.py applies the
    same to a single request): its models, its priority ceiling (never above the bulk lane)."""
    if who.key is None:
        return {}
    return {"models": list(who.key.models),
            "priority_ceiling": max(BATCH_PRIORITY, who.key.priority_ceiling)}


def check_metadata(raw: Any) -> Optional[dict[str, str]]:
    if raw is None:
        return None
    n, klen, vlen = MAX_METADATA
    if not (isinstance(raw, dict) and len(raw) <= n and all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= klen and len(v) <= vlen
            for k, v in raw.items())):
        raise APIError(400, f"metadata must be an object of at most {n} string pairs (keys up "
                            f"to {klen} characters, values up to {vlen})", param="metadata",
                       code="invalid_value")
    return raw


def install_batch_api(app: FastAPI, gw, options: Optional[BatchOptions] = None) -> BatchAPI:
    """The /v1/files and /v1/batches routes; the gateway's lifespan calls start() and stop()."""
    api = BatchAPI(gw, options or BatchOptions())
    install_file_routes(app, api)

    @app.post("/v1/batches")
    async def create_batch(request: Request):
        return await api.create(request, await api.principal(request))

    @app.get("/v1/batches")
    async def list_batches(request: Request):
        tenant = await api.authorize(request)
        after, limit = list_args(request)
        views, more = await api.batches.list(after, limit, tenant)
        return listing([v.public() for v in views], more)

    @app.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str, request: Request):
        return (await api.owned(await api.authorize(request), batch_id)).public()

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str, request: Request):
        await api.owned(await api.authorize(request), batch_id)
        moved, state = await api.batches.move(batch_id, "", ("validating", "in_progress"),
                                              "cancelling", "cancelling_at")
        if moved != 1 and state not in ("cancelling", "cancelled"):
            raise APIError(409, f"Cannot cancel a batch with status {state}", param="batch_id",
                           code="invalid_state")
        if api.driver is not None:
            api.driver.wake.set()
        return (await api.batches.get(batch_id)).public()

    return api
