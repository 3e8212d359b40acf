"""The gateway's request plumbing: JSON bodies of sane size, server-sent events, fire-and-forget
tasks, bounds on open requests, and awaiting the job while watching for the HTTP client to hang
up (producer/gateway.py)."""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from genpool.schemas.connection import redact_text

from .errors import NoWorkers
from .openai_format import APIError, scrub_paths

log = logging.getLogger("genpool.gateway")
# The worker refuses a job above 8 MiB (workers/intake.py); a body past this is refused unread.
MAX_BODY_BYTES = 8 << 20
_background: set[asyncio.Task] = set()  # strong refs so fire-and-forget cancels are not GC'd


class ClientGone(Exception):
    """The HTTP client disconnected."""


class OpenRequests:
    """Completion requests in flight (streamed or not), in all and per client. One client's
    never-read streams held every worker slot (200 of them made another caller's request time
    out at 60 s); past its share a client gets 429, past the total everyone gets 503. One event
    loop updates it: no lock."""

    def __init__(self, total: int, per_client: int):
        if total < 1 or per_client < 1:
            raise ValueError(f"open-request bounds must be >= 1 (got {total}, {per_client})")
        self.total, self.per_client = total, per_client
        self.by_client: dict[str, int] = {}
        self.open = 0

    def enter(self, who: str) -> Callable[[], None]:
        """Count one more request of `who`; returns the release, which only its first call does."""
        if self.open >= self.total:
            raise APIError(503, f"the gateway has {self.open} requests open (limit "
                                f"{self.total}); retry later", "server_error", code="gateway_busy")
        n = self.by_client.get(who, 0)
        if n >= self.per_client:
            raise APIError(429, f"this client has {n} requests open (limit {self.per_client} per "
                                f"client); finish or close one first",
                           type_="rate_limit_exceeded", code="too_many_open_requests")
        self.by_client[who], self.open = n + 1, self.open + 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.open -= 1
                left = self.by_client.pop(who) - 1
                if left:
                    self.by_client[who] = left
        return release


class ClosingStream(StreamingResponse):
    """A StreamingResponse that closes its generator (whose `finally` cancels an unfinished job)
    and runs `on_close` however it ends: done, client gone, reader dropped, error."""

    def __init__(self, content: AsyncIterator, on_close: Callable[[], None], **kw: Any):
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            finally:
                self._on_close()


async def read_json(request: Request, idle_timeout_s: Optional[float] = None) -> Any:
    """The body as JSON, refusing (OpenAI-shaped 4xx) anything but a JSON body of sane size and
    depth, or one whose sender goes quiet for `idle_timeout_s` (408, and the connection closed).
    Only application/json: a browser can send text/plain or form bodies cross-site without
    a preflight, and those must never become jobs."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype and ctype != "application/json":  # (no header at all is no browser's doing)
        raise APIError(415, f"Content-Type must be application/json (got {ctype!r})",
                       code="unsupported_media_type")
    size = request.headers.get("content-length")
    if size is not None and size.isascii() and size.isdigit() and int(size) > MAX_BODY_BYTES:
        raise APIError(400, f"the request body is {size} bytes; the limit is {MAX_BODY_BYTES}",
                       code="body_too_large")
    raw = bytearray()
    chunks = request.stream().__aiter__()
    while True:
        try:
            raw += await asyncio.wait_for(chunks.__anext__(), idle_timeout_s)
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body stalled (no data for {idle_timeout_s:g} s)",
                           code="request_timeout", headers={"Connection": "close"}) from None
        if len(raw) > MAX_BODY_BYTES:
            raise APIError(400, f"the request body is over the {MAX_BODY_BYTES}-byte limit",
                           code="body_too_large")
    try:
        return json.loads(raw)
    except RecursionError:
        raise APIError(400, "the request body's JSON is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})") from None


def bounded(request: Request, max_bytes: int, idle_timeout_s: Optional[float],
            too_large: APIError) -> Request:
    """`request` again, for a parser that reads the body itself (a multipart form): past
    `max_bytes` of body it raises `too_large`, and 408 (the connection closed) when the sender
    goes quiet for `idle_timeout_s`, while the body is still arriving. Without it, a chunked
    upload spools to disk to its end whatever its size, and a stalled one is held forever."""
    receive, got = request.receive, 0

    async def guarded() -> Any:
        nonlocal got
        try:
            message = await asyncio.wait_for(receive(), idle_timeout_s)
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body stalled (no data for {idle_timeout_s:g} s)",
                           code="request_timeout", headers={"Connection": "close"}) from None
        got += len(message.get("body", b""))
        if got > max_bytes:
            raise too_large
        return message
    return Request(request.scope, guarded)


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
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        # the response itself was cancelled (Starlette's own disconnect listener can see the
        # hang-up before `watcher` does): `task`, a Redis read, must not live on without it
        background(stop_task(task))
        raise
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


def queue_error(exc: redis.RedisError) -> APIError:
    """The 503 an HTTP caller gets: no password, no path of this machine."""
    return APIError(503, f"the job queue is unreachable ({type(exc).__name__}: "
                         f"{scrub_paths(redact_text(str(exc)))})", "server_error",
                    code="queue_unavailable")


def no_workers_error(exc: NoWorkers) -> APIError:
    """The 503 of a request that waited `no_worker_wait_s` with no live worker for its model."""
    return APIError(503, scrub_paths(str(exc)), "server_error", code="no_workers")


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves in OpenAI's shape, including FastAPI's own 404 / 405 / 422."""

    @app.exception_handler(APIError)
    async def api_error(_req, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(_req, exc: Exception):  # never a plain-text 500, never a traceback
        log.exception("unhandled error in the gateway")
        err = APIError(500, f"internal error ({type(exc).__name__})", "server_error",
                       code="internal")
        return JSONResponse(err.body(), status_code=500)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(req, _exc: ClientDisconnect):  # a body cut short: no server error
        log.info("%s %s: the client hung up before its body ended", req.method, req.url.path)
        return Response(status_code=499)  # nobody reads it; nginx's "client closed" code

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_req, exc: StarletteHTTPException):
        err = APIError(exc.status_code, str(exc.detail),
                       "invalid_request_error" if exc.status_code < 500 else "server_error")
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(redis.RedisError)
    async def queue_down(_req, exc: redis.RedisError):
        return JSONResponse(queue_error(exc).body(), status_code=503)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_req, exc: RequestValidationError):
        return JSONResponse(APIError(400, str(exc.errors())).body(), status_code=400)
