"""OpenAI's Files API on the gateway (`/v1/files`), for the Batch API: upload, list, get, content,
delete. Files live in Redis (producer/batch_store.py), so every gateway serves every file.

An upload is checked line by line before it is stored: each non-blank line must be a JSON object
with a unique `custom_id`, `method` POST, a `url` the Batch API runs and a `body` object. A file
with bad lines is refused, naming them. What a body asks for is checked when its batch runs, so
one bad request becomes one line of the batch's error file instead of failing the batch.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Optional

import redis
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.datastructures import UploadFile
from starlette.requests import ClientDisconnect

from genpool.schemas import Keys
from genpool.schemas.batch_scripts import BATCH_LEASE_LUA, BATCH_RELEASE_LUA
from genpool.schemas.batches import (
    BAD_LINES_SHOWN,
    FILE_TTL_S,
    MAX_BATCH_LINES,
    MAX_LIST_LIMIT,
    STORAGE_LOCK_MS,
    STORAGE_LOCK_WAIT_S,
    FileRecord,
    LineError,
)
from genpool.schemas.scripting import Script
from genpool.schemas.tenants import TenantKeys

from .gateway_io import bounded
from .jsonl import jsonl_lines, line_object
from .openai_format import ENDPOINTS, APIError, one_of

LOCK, UNLOCK = Script(BATCH_LEASE_LUA), Script(BATCH_RELEASE_LUA)
FORM_SLACK = 64 << 10  # multipart framing and the purpose field around the file itself


def visible(owner: str, tenant: str) -> bool:
    """The one rule of who sees a file or batch: the tenant that made it (the caller's tenant
    comes from its API key: producer/tenancy.py; without stored keys every caller is
    DEFAULT_OWNER)."""
    return owner == tenant


def line_problem(raw: str, seen: set[str]) -> Optional[str]:
    """Why a batch input line cannot be a request at all (None: it can)."""
    obj = line_object(raw)
    if isinstance(obj, str):
        return obj
    cid = obj["custom_id"]
    if cid in seen:
        return f"custom_id {cid!r} repeats an earlier line"
    seen.add(cid)
    if obj.get("method") != "POST":
        return f"method must be POST (got {obj.get('method')!r})"
    if not one_of(obj.get("url"), ENDPOINTS):
        return f"url must be one of {', '.join(ENDPOINTS)} (got {obj.get('url')!r})"
    if not isinstance(obj.get("body"), dict):
        return "body must be a JSON object"
    return None


def check_lines(text: str) -> tuple[int, list[LineError]]:
    """(non-blank lines, the bad ones) of a batch input file."""
    seen: set[str] = set()
    bad, n = [], 0
    for lineno, raw in jsonl_lines(text):
        n += 1
        why = line_problem(raw, seen)
        if why:
            bad.append(LineError(code="invalid_line", message=why, line=lineno))
    return n, bad


def parse_upload(data: bytes) -> tuple[str, int]:
    """The file as text and its line count; APIError(400) naming what is wrong with it."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the file is not UTF-8 text, so not JSONL ({e})", param="file",
                       code="invalid_file") from None
    n, bad = check_lines(text)
    if bad:
        shown = "; ".join(f"line {e.line}: {e.message}" for e in bad[:BAD_LINES_SHOWN])
        more = f" (and {len(bad) - BAD_LINES_SHOWN} more)" if len(bad) > BAD_LINES_SHOWN else ""
        raise APIError(400, f"the file is not a valid batch input: {len(bad)} bad lines: "
                            f"{shown}{more}", param="file", code="invalid_file")
    if n == 0:
        raise APIError(400, "the file has no lines", param="file", code="invalid_file")
    if n > MAX_BATCH_LINES:
        raise APIError(400, f"the file has {n} lines; a batch takes at most {MAX_BATCH_LINES}",
                       param="file", code="invalid_file")
    return text, n


async def read_upload(request: Request, max_bytes: int,
                      idle_timeout_s: Optional[float]) -> tuple[str, bytes]:
    """(filename, content) of a multipart upload with purpose=batch."""
    size = request.headers.get("content-length", "")
    if size.isascii() and size.isdigit() and int(size) > max_bytes + FORM_SLACK:
        raise APIError(413, f"the upload is {size} bytes; files are limited to {max_bytes}",
                       param="file", code="file_too_large")
    too_large = APIError(413, f"the upload is over {max_bytes + FORM_SLACK} bytes; files are "
                              f"limited to {max_bytes}", param="file", code="file_too_large",
                         headers={"Connection": "close"})  # the rest of the body is not read
    form = await bounded(request, max_bytes + FORM_SLACK, idle_timeout_s, too_large).form(
        max_files=1, max_fields=4)
    try:
        purpose, up = form.get("purpose"), form.get("file")
        if purpose != "batch":
            raise APIError(400, f"purpose must be 'batch' (got {purpose!r}): this server keeps "
                                f"files for the Batch API only", param="purpose",
                           code="invalid_value")
        if not isinstance(up, UploadFile):
            raise APIError(400, "a multipart field 'file' holding the file is required",
                           param="file", code="invalid_value")
        data = await up.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise APIError(413, f"the file is over the {max_bytes}-byte limit", param="file",
                           code="file_too_large")
        return (up.filename or "upload.jsonl")[:256], data
    finally:
        await form.close()


async def file_room(api, tenant: str, size: int) -> None:
    """APIError(429) unless `tenant`'s uploaded files leave room for `size` more bytes."""
    limit = api.options.max_tenant_file_bytes
    held = await api.files.uploaded_bytes(tenant)
    if held + size > limit:
        raise APIError(429, f"this tenant's uploaded files hold {held} bytes; with this upload's "
                            f"{size} that is over the limit of {limit}: delete files (they "
                            f"expire after {FILE_TTL_S // 86400} days)",
                       type_="rate_limit_exceeded", code="file_storage_limit_exceeded")


@contextlib.asynccontextmanager
async def storage_lock(r, keys: Keys, tenant: str, wait_s: float = STORAGE_LOCK_WAIT_S):
    """Hold `tenant`'s storage lock across gateways for a check of its byte limits and the write
    it allows: two uploads (or creates) checked side by side each saw the other's bytes unheld,
    and both passed. APIError(503) when it is not had within `wait_s`."""
    key, token = TenantKeys(keys).storage_lock(tenant), uuid.uuid4().hex
    give_up = time.monotonic() + wait_s
    while await LOCK.acall(r, [key], [token, STORAGE_LOCK_MS]) != 1:
        if time.monotonic() > give_up:
            raise APIError(503, f"this tenant's uploads and batch creates are busy (waited "
                                f"{wait_s:g} s); retry", "server_error", code="storage_busy")
        await asyncio.sleep(0.02)
    keeper = asyncio.create_task(_keep_lock(r, key, token))  # a big file's write outlasts it
    try:
        yield
    finally:
        keeper.cancel()
        await UNLOCK.acall(r, [key], [token])


async def _keep_lock(r, key: str, token: str) -> None:
    try:
        while True:
            await asyncio.sleep(STORAGE_LOCK_MS / 3000)
            await LOCK.acall(r, [key], [token, STORAGE_LOCK_MS])
    except redis.RedisError:  # (the lock then lapses on its own)
        return


def declared_file_bytes(request: Request) -> int:
    """At least how many bytes the upload's file has, by its Content-Length (0 when unknown)."""
    size = request.headers.get("content-length", "")
    return max(0, int(size) - FORM_SLACK) if size.isascii() and size.isdigit() else 0


def list_args(request: Request) -> tuple[Optional[str], int]:
    """`after` and `limit` of a list request (OpenAI's cursor pagination)."""
    q = request.query_params
    raw = q.get("limit", "20")
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= MAX_LIST_LIMIT:
        raise APIError(400, f"limit must be an integer in [1, {MAX_LIST_LIMIT}] (got {raw!r})",
                       param="limit", code="invalid_value")
    return q.get("after") or None, int(raw)


def listing(data: list[dict], has_more: bool) -> dict:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


def install_file_routes(app: FastAPI, api) -> None:
    """`api`: the gateway's BatchAPI (producer/openai_batches.py): authorize, files, limits."""

    async def owned(tenant: str, file_id: str) -> FileRecord:
        rec = await api.files.get(file_id)
        if rec is None or not visible(rec.owner, tenant):
            raise APIError(404, f"No such File object: {file_id}", param="file_id",
                           code="not_found")
        return rec

    @app.post("/v1/files")
    async def upload(request: Request):
        tenant = await api.authorize(request)
        await file_room(api, tenant, declared_file_bytes(request))  # before the body is read
        # an upload holds a connection (and up to a file's bytes) while it arrives: counted as
        # a completion is, so one client's slow uploads cannot take every place
        release = api.gw.open.enter(api.gw.caller(request))
        try:
            filename, data = await read_upload(request, api.max_file_bytes, api.gw.idle_timeout_s)
        except ClientDisconnect:
            return Response(status_code=499)  # nobody reads the answer; nginx's "client closed"
        finally:
            release()
        # checked on the check threads: a 64 MB file's lines take a second or more to parse
        text, n = await asyncio.get_running_loop().run_in_executor(api.gw.checks, parse_upload,
                                                                  data)
        rec = FileRecord(id=f"file-{uuid.uuid4().hex[:24]}", bytes=len(data),
                         created_at=int(time.time()), filename=filename, purpose="batch",
                         lines=n, owner=tenant)
        async with storage_lock(api.files.r, api.files.keys, tenant):
            await file_room(api, tenant, len(data))
            await api.files.put(rec, text)
        return rec.public()

    @app.get("/v1/files")
    async def list_files(request: Request):
        tenant = await api.authorize(request)
        after, limit = list_args(request)
        recs, more = await api.files.list(after, limit, tenant,
                                          request.query_params.get("purpose") or None)
        return listing([r.public() for r in recs], more)

    @app.get("/v1/files/{file_id}")
    async def get_file(file_id: str, request: Request):
        return (await owned(await api.authorize(request), file_id)).public()

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str, request: Request):
        await owned(await api.authorize(request), file_id)
        text = await api.files.content(file_id)
        return Response(text or "", media_type="application/jsonl")

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str, request: Request):
        await owned(await api.authorize(request), file_id)
        await api.files.delete(file_id)
        return {"id": file_id, "object": "file", "deleted": True}
