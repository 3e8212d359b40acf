"""OpenAI-compatible HTTP gateway: requests become queue jobs; tokens come back from job streams.

Needs fastapi + uvicorn (the `gateway` extra); `import producer` never imports this module.
The gateway holds no model: it validates, enqueues through the AsyncClient, and relays the job's
event stream (producer/gateway_stream.py when streamed), so any number of gateways can front one
pool.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from genpool.schemas import Keys
from genpool.schemas.config import key_prefix, redis_url
from genpool.schemas.connection import connect_async, lane_depths, queue_lane_depths
from genpool.schemas.keys import check_memory_policy
from genpool.schemas.request import CALLER_PRIORITY_CEILING, check_priority
from genpool.schemas.tenants import known_sub_streams, queue_known

from .aio import AsyncClient
from .errors import NoWorkers
from .gateway_http import SameOriginOnly
from .gateway_io import (
    ClientGone,
    ClosingStream,
    OpenRequests,
    install_error_handlers,
    no_workers_error,
    read_json,
    until_disconnect,
)
from .gateway_jobs import install_job_routes
from .gateway_stream import start_stream
from .liveness import live_workers_async, served_names, serving
from .openai_batches import BatchOptions, install_batch_api
from .openai_format import APIError, OpenAIRequest, error_from_event, parse_body, scrub_paths
from .openai_response import completion_body
from .tenancy import Principal, Tenancy

log = logging.getLogger("genpool.gateway")

# HTTP callers are waiting: the interactive lane, which workers read first, and no sooner
GATEWAY_PRIORITY = CALLER_PRIORITY_CEILING
# llguidance's check of a ~1 MB schema takes ~1.6 s: on the event loop, 4 such requests stalled
# every other request (/health too) for 6.6 s. It runs on this many threads instead (it releases
# the GIL); a fixed number, so requests cannot make the gateway start threads without bound.
CHECK_THREADS = 2
# Completion requests in flight (streamed or not): in all (each streamed one holds a Redis
# connection in XREAD BLOCK, so keep it under max_connections), and per client.
MAX_OPEN, MAX_OPEN_PER_CLIENT = 512, 32
# a request already queued answers 503 no_workers when no live worker has served its model this
# long (a worker that restarts is gone for its model's load, ~10-20 s for SmolLM2 here)
NO_WORKER_WAIT_S = 60.0
IDLE_TIMEOUT_S = 5.0  # a request body that goes quiet this long gets 408 (gateway_http.py: same)


def _served_name(live: list) -> Optional[str]:
    """The primary model name a model-less request is served under, when the live workers
    agree on one (the usual one-model pool); None otherwise (responses then say "genpool")."""
    names = {w.model_name for w in live}
    name = names.pop() if len(names) == 1 else ""
    return name if name and scrub_paths(name) == name else None  # never a filesystem path


def constrains(body: dict) -> bool:
    """Whether parse_body builds a constraint for llguidance to check: a response_format, a
    structured_outputs, or tools with a forced call ("required" or a named one)."""
    if body.get("response_format") is not None or body.get("structured_outputs") is not None:
        return True
    return bool(body.get("tools")) and body.get("tool_choice") not in (None, "auto", "none")


class Gateway:
    def __init__(self, url: Optional[str], prefix: Optional[str], api_keys: Iterable[str],
                 max_queue_depth: Optional[int], priority: int, default_model: Optional[str],
                 max_connections: int, no_worker_grace_s: float = 5.0,
                 queue_without_workers: bool = False, *, max_open: int = MAX_OPEN,
                 max_open_per_client: int = MAX_OPEN_PER_CLIENT,
                 idle_timeout_s: float = IDLE_TIMEOUT_S, stored_keys: bool = False,
                 no_worker_wait_s: float = NO_WORKER_WAIT_S):
        self.url, self.keys = redis_url(url), Keys(key_prefix(prefix))
        # how long a submitted request waits with no live worker for its model (None: for ever)
        self.no_worker_wait_s = None if queue_without_workers else no_worker_wait_s
        self.open, self.idle_timeout_s = OpenRequests(max_open, max_open_per_client), idle_timeout_s
        self.api_keys = [k.encode() for k in api_keys if k]
        self.tenancy = Tenancy(self.keys, self.api_keys, stored_keys)  # producer/tenancy.py
        self.max_queue_depth, self.priority = max_queue_depth, priority
        self.default_model, self.max_connections = default_model, max_connections
        self.no_worker_grace_s, self.queue_without_workers = no_worker_grace_s, queue_without_workers
        self.client: Optional[AsyncClient] = None
        self.checks: Optional[ThreadPoolExecutor] = None

    async def start(self) -> None:
        self.checks = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="genpool-gw-check")
        # On one server a blocking pool: each streaming request holds a connection in XREAD
        # BLOCK, and past the cap requests should wait for one rather than fail
        # (schemas/connection.py: per node in a cluster, uncapped behind Sentinel).
        self.client = AsyncClient(self.url, self.keys.prefix, redis_client=connect_async(
            self.url, max_connections=self.max_connections, decode_responses=True),
            check_quota=False)  # producer/tenancy.py charges quotas, with OpenAI's headers
        await check_memory_policy(self.client.redis, log)  # an evicting Redis loses jobs
        self.tenancy.start(self.client.redis)

    async def stop(self) -> None:
        if self.checks is not None:
            self.checks.shutdown(wait=False, cancel_futures=True)
        if self.client is not None:
            await self.client.close()

    async def parse(self, kind: str, body) -> OpenAIRequest:
        """parse_body; one whose constraint llguidance must check runs on the check threads
        (tools too: a forced call's constraint is built from their schemas)."""
        parse = functools.partial(parse_body, kind, body, priority=self.priority,
                                  default_model=self.default_model)
        if not (isinstance(body, dict) and constrains(body)):
            return parse()  # no constraint: microseconds, not worth a thread hop
        return await asyncio.get_running_loop().run_in_executor(self.checks, parse)

    async def authorize(self, request: Request) -> Principal:
        """401 unless the request carries a key this gateway accepts (when it checks keys)."""
        return await self.tenancy.principal(request.headers.get("authorization", ""))

    def caller(self, request: Request) -> str:
        """Whom the per-client bound counts: the API key when keys are checked (each key a caller),
        else the peer's address (behind a proxy, the one uvicorn's forwarded-allow-ips trusts)."""
        if self.tenancy.checks_keys:
            return "key:" + request.headers.get("authorization", "")[7:].strip()
        return "ip:" + (request.client.host if request.client else "unknown")

    async def queue_depth(self) -> int:
        """Entries no worker has picked up yet, over all lanes (pending ones are being served)."""
        keys = await self.client.lane_keys()
        pipe = self.client.redis.pipeline(transaction=False)
        queue_known(pipe, keys)  # tenants' sub-streams (fair pull) hold queued jobs too
        subs = known_sub_streams(keys, await pipe.execute(raise_on_error=False))
        pipe = self.client.redis.pipeline(transaction=False)
        queue_lane_depths(pipe, keys, subs)
        depths = lane_depths(await pipe.execute(raise_on_error=False),
                             [keys.lane_of_stream(s) for s in subs])
        return sum(queued for queued, _ in depths.values())

    async def models(self) -> list[dict]:
        """One entry per model the live workers serve: its primary name as the id, the other
        names it answers to under `aliases` (a genpool extension OpenAI clients ignore)."""
        by_id: dict[str, dict] = {}
        for w in await live_workers_async(self.client.redis, self.keys):
            names = {n for n in served_names(w) if scrub_paths(n) == n}  # never a filesystem path
            if not names:
                continue
            primary = w.model_name
            primary = primary if primary in names else min(names)
            m = by_id.setdefault(primary, {"id": primary, "object": "model",
                                           "created": int(w.started),
                                           "owned_by": "genpool", "aliases": set()})
            m["aliases"] |= names - {primary}
        return [{**m, "aliases": sorted(m["aliases"] - by_id.keys())}
                for _, m in sorted(by_id.items())]

    async def require_workers(self, model: Optional[str]) -> list:
        """The live workers that serve `model`; 503 `no_workers` when none does within the grace
        (workers can be starting); an operator who wants jobs queued for later sets
        queue_without_workers (then: [])."""
        if self.queue_without_workers:
            return []
        deadline = time.monotonic() + self.no_worker_grace_s
        while not (found := serving(live := await live_workers_async(self.client.redis, self.keys),
                                    model)):
            others = sorted({n for w in serving(live, None) for n in served_names(w)})
            if model and others:  # the pool is up, it just does not have this model
                raise APIError(404, f"The model '{model}' does not exist; this pool serves "
                                    f"{', '.join(others)}", param="model", code="model_not_found")
            if time.monotonic() >= deadline:
                target = f"model '{model}'" if model else "any model"
                raise APIError(503, f"no live worker serves {target} (waited "
                                    f"{self.no_worker_grace_s:g} s); start one with `genpool "
                                    f"worker`, or run the gateway with --queue-without-workers to "
                                    f"queue jobs until one comes", "server_error",
                               code="no_workers")
            await asyncio.sleep(min(0.25, self.no_worker_grace_s))
        return found

    async def complete(self, request: Request, kind: str) -> Response:
        principal = await self.authorize(request)
        await self.tenancy.precheck(principal, self.client.redis)  # over its rpm: no parse
        release = self.open.enter(self.caller(request))  # before the body: slow bodies count too
        streaming = False
        try:
            resp = await self._complete(request, kind, release, principal)
            streaming = isinstance(resp, ClosingStream)  # it releases when the stream ends
            return resp
        finally:
            if not streaming:
                release()

    async def _complete(self, request: Request, kind: str, release,
                        principal: Principal) -> Response:
        body = await read_json(request, self.idle_timeout_s)
        req = await self.parse(kind, body)
        try:  # lower runs first: the server's value is a ceiling
            check_priority(req.kwargs["priority"], self.priority, "this gateway")
        except ValueError as e:
            raise APIError(400, str(e), param="priority", code="invalid_value") from None
        if self.max_queue_depth is not None:
            depth = await self.queue_depth()
            if depth > self.max_queue_depth:
                raise APIError(429, f"the queue holds {depth} waiting jobs (limit "
                                    f"{self.max_queue_depth}); retry later",
                               type_="rate_limit_exceeded", code="queue_full")
        live = await self.require_workers(req.kwargs.get("model"))
        if not req.kwargs.get("model"):  # answer with the name of the model that serves it
            req.model = _served_name(live) or req.model
        headers = await self.tenancy.admit(principal, req, isinstance(body, dict) and "priority"
                                           in body, self.client.redis)  # 429 when over quota
        job = await self.client.submit(**req.kwargs)
        try:
            if req.stream:
                resp = await start_stream(request, job, req, release, self.no_worker_wait_s)
                resp.headers.update(headers)
                return resp
            res = await until_disconnect(request, job.result(raise_on_error=False,
                                                             no_worker_s=self.no_worker_wait_s))
        except ClientGone:
            await job.cancel()
            return Response(status_code=499)  # nobody reads it; nginx's "client closed" code
        except NoWorkers as exc:
            await job.cancel()
            raise no_workers_error(exc) from None
        if res.error is not None:
            raise error_from_event(res.error)
        return JSONResponse(completion_body(req, res), headers=headers)


def create_app(url: Optional[str] = None, prefix: Optional[str] = None, *,
               api_keys: Iterable[str] = (), max_queue_depth: Optional[int] = None,
               priority: int = GATEWAY_PRIORITY, default_model: Optional[str] = None,
               max_connections: int = 1000, no_worker_grace_s: float = 5.0,
               queue_without_workers: bool = False, max_open: int = MAX_OPEN,
               max_open_per_client: int = MAX_OPEN_PER_CLIENT,
               idle_timeout_s: float = IDLE_TIMEOUT_S, stored_keys: bool = False,
               batch: Optional[BatchOptions] = None, no_worker_wait_s: float = NO_WORKER_WAIT_S) -> FastAPI:
    """The gateway app. Served by `genpool gateway`, it also gets the connection timeouts of
    producer/gateway_http.py (header, idle, send); another server must bring its own.
    `batch`: the Files and Batch API's options (producer/openai_batches.py)."""
    gw = Gateway(url, prefix, api_keys, max_queue_depth, priority, default_model,
                 max_connections, no_worker_grace_s, queue_without_workers, max_open=max_open,
                 max_open_per_client=max_open_per_client, idle_timeout_s=idle_timeout_s,
                 stored_keys=stored_keys, no_worker_wait_s=no_worker_wait_s)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await gw.start()
        await batches.start()
        yield
        await batches.stop()
        await gw.stop()

    app = FastAPI(title="genpool gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = gw
    if not gw.tenancy.checks_keys:  # (a browser cannot send a key cross-site unpreflighted)
        app.add_middleware(SameOriginOnly)
    install_error_handlers(app)
    batches = install_batch_api(app, gw, batch)
    install_job_routes(app, gw)  # /v1/jobs/{id}: a job by id, the caller's tenant's only
    _install_model_routes(app, gw)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await gw.complete(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await gw.complete(request, "completion")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    return app


def _install_model_routes(app: FastAPI, gw: Gateway) -> None:
    """/v1/models and /v1/models/{id}: what the live workers serve, aliases included."""
    @app.get("/v1/models")
    async def list_models(request: Request):
        await gw.authorize(request)
        return {"object": "list", "data": await gw.models()}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request):
        await gw.authorize(request)
        found = [m for m in await gw.models() if model_id == m["id"] or model_id in m["aliases"]]
        if not found:
            raise APIError(404, f"The model '{model_id}' does not exist", param="model",
                           code="model_not_found")
        return found[0]
