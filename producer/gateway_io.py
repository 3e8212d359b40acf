"""The gateway's request plumbing: JSON bodies of sane size, server-sent events, fire-and-forget
tasks, and awaiting the job while watching for the HTTP client to hang up (producer/gateway.py)."""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator, Awaitable

from fastapi import Request

from .openai_format import APIError

log = logging.getLogger("genpool.gateway")
MAX_BODY_BYTES = 8 << 20
_background: set[asyncio.Task] = set()  # strong refs so fire-and-forget cancels are not GC'd


class ClientGone(Exception):
    """The HTTP client disconnected."""


async def read_json(request: Request) -> Any:
    """The body as JSON, refusing (OpenAI-shaped 4xx) anything but a JSON body of sane size and
    depth. Only application/json: a browser can send text/plain or form bodies cross-site without
    a preflight, and those must never become jobs."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype and ctype != "application/json":  # (no header at all is no browser's doing)
        raise APIError(415, f"Content-Type must be application/json (got {ctype!r})",
                       code="unsupported_media_type")
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
        raise APIError(400, f"the request body is {size} bytes; the limit is {MAX_BODY_BYTES}",
                       code="body_too_large")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise APIError(400, f"the request body is over the {MAX_BODY_BYTES}-byte limit",
                           code="body_too_large")
    try:
        return json.loads(raw)
    except RecursionError:
        raise APIError(400, "the request body's JSON is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})") from None


async def chain(first: Any, rest: AsyncIterator) -> AsyncIterator:
    if first is not None:
        yield first
    async for item in rest:
        yield item


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def background(coro: Awaitable) -> None:
    task = asyncio.ensure_future(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)


async def wait_disconnect(request: Request) -> None:
    """Returns when the client hangs up (the body has been read, so receive() only reports
    the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _race(aw: Awaitable, watcher: asyncio.Future) -> Any:
    task = asyncio.ensure_future(aw)
    await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if not task.done():
        await stop_task(task)
        raise ClientGone()
    return task.result()


async def stop_task(task: asyncio.Future, tries: int = 50, every_s: float = 0.1) -> None:
    """Cancel `task` and wait for it to end. Cancelling again until it does: redis-py's asyncio
    client can swallow a cancellation that lands at an unlucky moment (reproduced: a task reading
    with XREAD BLOCK kept running after cancel()), and awaiting such a task once hung the request
    forever, so a disconnected client's job was never cancelled. Whatever the task ends with
    after the cancel (a redis error raised by the interrupted read, say) is moot and only logged:
    the caller must go on to cancel the job."""
    for _ in range(tries):
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=every_s)
        if done:
            _outcome_after_cancel(task)
            return
    log.warning("a cancelled request task is still running after %d cancels; leaving it", tries)
    _background.add(task)  # referenced until it ends, and its outcome read then
    task.add_done_callback(_background.discard)
    task.add_done_callback(_outcome_after_cancel)


def _outcome_after_cancel(task: asyncio.Future) -> None:
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None and not isinstance(exc, StopAsyncIteration):
        log.debug("a cancelled request task ended with %r", exc)


async def until_disconnect(request: Request, aw: Awaitable) -> Any:
    """Await `aw`; raise ClientGone (cancelling `aw`) if the client disconnects first."""
    watcher = asyncio.ensure_future(wait_disconnect(request))
    try:
        return await _race(aw, watcher)
    finally:
        watcher.cancel()


async def iterate_until_disconnect(request: Request, ait: AsyncIterator) -> AsyncIterator:
    """Items of `ait` until it ends; ClientGone as soon as the client disconnects, even while
    no item is coming (a queued job sends nothing for a long time)."""
    watcher = asyncio.ensure_future(wait_disconnect(request))
    it = ait.__aiter__()
    try:
        while True:
            try:
                item = await _race(it.__anext__(), watcher)
            except StopAsyncIteration:
                return
            yield item
    finally:
        watcher.cancel()
