"""A streamed completion through the gateway (`"stream": true`): answer once the job's first
event is in, then relay its events as OpenAI chunks over server-sent events, up to the closing
finish_reason / usage chunks and `[DONE]`.

The HTTP status is chosen before the first byte: a job its worker refuses (unknown model,
prompt too long) gets its real status, not a 200 stream that carries an error. Once the 200 is
sent, a failure can only be an error chunk. A reader that leaves cancels the job, so its worker
slot is freed (producer/gateway.py holds the rest of the completion routes).
"""
from __future__ import annotations

import logging
import time
from typing import AsyncIterator, Callable, Optional

import redis
from fastapi import Request
from fastapi.responses import Response

from genpool.schemas import JobResult, TokenEvent
from genpool.schemas.connection import redact_text

from . import openai_logprobs
from .aio import AsyncJob
from .errors import NoWorkers
from .gateway_io import (
    ClientGone,
    ClosingStream,
    background,
    chain,
    iterate_until_disconnect,
    no_workers_error,
    queue_error,
    sse,
    until_disconnect,
)
from .openai_format import APIError, OpenAIRequest, error_from_event
from .openai_response import chunk_body, echo_chunks, final_chunks

log = logging.getLogger("genpool.gateway")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

# Why a stream ends early: the job's text changed under text already sent (producer/replay.py)
_TAKEN_BACK = {
    "restart": "the job was rerun after a worker failure and its new output differs from what "
               "was streamed; retry",
    "rewind": "Redis lost the tail of the job's stream after a failure: the job goes on from "
              "fewer tokens than were streamed; retry",
}


async def start_stream(request: Request, job: AsyncJob, req: OpenAIRequest,
                       release: Callable[[], None], no_worker_s: Optional[float] = None) -> Response:
    """Answers once the job's first event is in, so a job its worker refuses (unknown
    model, prompt too long) gets its real HTTP status rather than a 200 stream. `no_worker_s`:
    how long it waits with no live worker for the job's model before a 503 (None: for ever)."""
    events = job.stream(raise_on_error=False, no_worker_s=no_worker_s).__aiter__()
    try:
        first = await until_disconnect(request, events.__anext__())
    except NoWorkers as exc:
        await job.cancel()
        raise no_workers_error(exc) from None
    except StopAsyncIteration:  # finished without a token: failed, or an empty completion
        first, res = None, await job.result(raise_on_error=False)
        if res.error is not None:
            raise error_from_event(res.error) from None
    return ClosingStream(relay(request, job, req, chain(first, events), no_worker_s), release,
                         headers=SSE_HEADERS, media_type="text/event-stream")


async def relay(request: Request, job: AsyncJob, req: OpenAIRequest,
                events: AsyncIterator, no_worker_s: Optional[float] = None) -> AsyncIterator[str]:
    """The job's events as SSE chunks in OpenAI's shape, then its closing chunks."""
    created, finished = int(time.time()), False
    offsets: dict[int, int] = {}  # per choice: where the next token's text starts
    echo = req.echo  # still to send: the prompt, once its scores are in (when asked)
    scored = "prompt_logprobs" in req.kwargs
    try:
        if req.kind == "chat":  # OpenAI opens every choice with the assistant role
            for i in range(req.kwargs.get("n", 1)):
                yield sse(chunk_body(req, job.id, created, i, role=True))
        async for ev in iterate_until_disconnect(request, events):
            if ev.type in ("restart", "rewind"):
                # Text already sent cannot be taken back; stop rather than send a mix.
                yield sse(APIError(500, _TAKEN_BACK[ev.type], "server_error",
                                   code="restarted").body())
                return
            if req.tools is not None and req.tools.active:
                continue  # held back: the end tells text from tool calls (final_chunks)
            if echo and isinstance(ev, TokenEvent) and (ev.prompt is not None or not scored):
                chunks, start = echo_chunks(req, job.id, created, ev.prompt)
                offsets, echo = dict.fromkeys(range(len(chunks)), start), False
                for c in chunks:
                    yield sse(c)
            with_lps = (req.top_logprobs is not None and isinstance(ev, TokenEvent)
                        and bool(ev.token_ids))
            if ev.text or with_lps:  # a token whose text is held back still has logprobs
                yield sse(chunk_body(req, job.id, created, ev.index, text=ev.text,
                                     token=ev if with_lps else None,
                                     offset=offsets.get(ev.index, 0)))
                if with_lps:
                    offsets[ev.index] = openai_logprobs.advance(
                        offsets.get(ev.index, 0), ev.token_ids, ev.token_texts or {})
        res = await job.result(raise_on_error=False, no_worker_s=no_worker_s)
        finished = True
        for c in _closing(req, job.id, created, res, echo):
            yield sse(c)
        yield "data: [DONE]\n\n"
    except ClientGone:
        pass
    except NoWorkers as exc:  # the 200 is sent: an error chunk; `finally` cancels the job
        log.warning("job %s: stream ended: %s", job.id, exc)
        yield sse(no_workers_error(exc).body())
    except redis.RedisError as exc:  # the 200 is sent: the error can only be an event
        log.warning("job %s: stream ended, the queue is unreachable: %s", job.id,
                    redact_text(str(exc)))
        yield sse(queue_error(exc).body())
    finally:
        if not finished:  # the reader left (or the stream broke): free the worker's slot
            background(job.cancel())


def _closing(req: OpenAIRequest, job_id: str, created: int, res: JobResult,
             echo: bool) -> list[dict]:
    """The chunks after the last token: an error chunk, or each choice's finish_reason (and
    usage when asked); led by the echoed prompt when it was never sent (`echo` still True)."""
    chunks = ([error_from_event(res.error).body()] if res.error is not None
              else final_chunks(req, res, created))
    if echo and res.error is None:  # nothing generated (max_tokens=0): the prompt alone
        chunks[:0] = echo_chunks(req, job_id, created, res.prompt)[0]
    return chunks
