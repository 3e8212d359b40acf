"""The synchronous handle on one submitted job: its raw events (reconnecting on a lost Redis),
its token stream with restart-aware replay, its final result, and cancelling it.

`Client.submit` returns one; producer/aio.py's AsyncJob is its asyncio twin.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Iterator, Optional

from genpool.schemas import TERMINAL, JobResult, RestartEvent, RewindEvent, TokenEvent, TrimmedEvent
from genpool.schemas.connection import xread_one
from genpool.schemas.workers import WorkerInfo

from . import openai_tools
from .errors import JobFailed
from .liveness import live_workers, serving
from .protocol import READ_BLOCK_MS, READ_COUNT, events_in, last_terminal, terminal_from_hash
from .replay import Gaps, Replay, read_events
from .retry import RETRY, retrying
from .waiting import Watch, final_result

if TYPE_CHECKING:  # only for annotations: client.py imports this module
    from .client import Client


def replayed_result(job_id: str, final, replay: Replay, raise_on_error: bool = True) -> JobResult:
    """The JobResult of a terminal event, with completion 0's text and ids as the replay holds
    them (what a cancelled job keeps). Job and producer/aio.py's AsyncJob share it."""
    t = replay.tracks.get(0)
    return final_result(job_id, final, t.text if t else "", t.ids if t else [], raise_on_error=raise_on_error)


def cancelled_result(job_id: str, final, raw: list) -> JobResult:
    """A cancelled job's result from its stream's raw entries: the text streamed before the cancel."""
    replay = Replay()
    for _, ev in events_in([(None, raw)]):
        replay.feed(ev)
    return replayed_result(job_id, final, replay)


def raise_if_failed(final: Optional[JobResult]) -> None:
    """JobFailed for a result that ended in an error (a cancel keeps its finish_reason)."""
    if final is not None and final.error is not None and final.finish_reason is None:
        raise JobFailed(final)


class Job:
    """Handle on one submitted job. `duplicate` is True when the id already existed.

    `result()` raises JobFailed when the job failed (`raise_on_error=False` returns the JobResult
    with `.error` instead); a cancelled job's result keeps the text streamed before the cancel,
    with finish_reason "cancelled". Waits raise NoWorkers (a TimeoutError) when they end while no
    live worker serves the job's model, and QueueUnavailable when Redis stays away (errors.py).
    A job submitted with `tools` has its results' `tool_calls` and `content` filled in."""

    def __init__(self, client: "Client", job_id: str, duplicate: bool = False,
                 model: Optional[str] = None, tools: Optional[openai_tools.Tools] = None):
        self.client, self.id, self.duplicate, self.model = client, job_id, duplicate, model
        self.tools = tools  # how to read the answer (producer/openai_tools.py)
        self._final: Optional[JobResult] = None

    def __repr__(self) -> str:
        return f"Job({self.id!r})"

    def _watch(self, timeout: Optional[float], no_worker_s: Optional[float]) -> Watch:
        c = self.client
        return Watch(self.id, self.model, c.keys.prefix, c.url, timeout, no_worker_s,
                     c.reconnect_s)

    def serving_workers(self) -> list[WorkerInfo]:
        """Live workers that would take this job (any model when the job names none)."""
        return serving(live_workers(self.client.redis, self.client.keys), self.model)

    def events(self, timeout: Optional[float] = None, start: str = "0-0",
               no_worker_s: Optional[float] = None) -> Iterator[Any]:
        """Raw events from `start` up to and including the terminal one (reconnects on loss),
        with a TrimmedEvent where the stream's cap dropped events before they were read."""
        return self._events(self._watch(timeout, no_worker_s), start)

    def _events(self, watch: Watch, last: str) -> Iterator[Any]:
        r, key = self.client.redis, self.client.keys.events(self.id)
        gaps = Gaps(last)  # events the stream's cap dropped before this reader got to them
        while True:
            try:
                if watch.check_due():
                    watch.saw_workers(len(self.serving_workers()))
                resp = xread_one(r, key, last, READ_COUNT, watch.block_ms(READ_BLOCK_MS))
                watch.redis_ok()
            except RETRY as e:
                resp = None
                time.sleep(watch.retry_after(e))
            if resp:
                watch.saw_events()  # a worker writes them: serving, even while it drains
            for entry_id, ev in read_events(resp, gaps):
                last = entry_id or last
                if ev is None:  # an entry to skip (protocol.decode_event)
                    continue
                yield ev
                if ev.type in TERMINAL:
                    return
            watch.after_read()

    def stream(self, timeout: Optional[float] = None, *, raise_on_error: bool = True,
               no_worker_s: Optional[float] = None
               ) -> Iterator[TokenEvent | RestartEvent | RewindEvent | TrimmedEvent]:
        """Token events from the start; a RestartEvent only if a rerun diverged (see replay.py);
        a RewindEvent where a worker resumed the job from fewer tokens than this reader saw;
        a TrimmedEvent where this reader fell so far behind that the stream's cap dropped events
        unread (their text is then missing here, never from `result()`). Ends normally on a
        result or a cancel; raises JobFailed on any other error."""
        replay = Replay()
        for raw in self.events(timeout, no_worker_s=no_worker_s):
            for ev in replay.feed(raw):
                if ev.type in TERMINAL:
                    self._final = openai_tools.attach(self.tools, replayed_result(
                        self.id, ev, replay, raise_on_error=False))
                else:
                    yield ev
        if raise_on_error:
            raise_if_failed(self._final)

    def result(self, timeout: Optional[float] = None, *, raise_on_error: bool = True,
               no_worker_s: Optional[float] = None) -> JobResult:
        if self._final is None:
            self._final = openai_tools.attach(self.tools, self._wait_final(timeout, no_worker_s))
        if raise_on_error:
            raise_if_failed(self._final)
        return self._final

    def _wait_final(self, timeout: Optional[float], no_worker_s: Optional[float]) -> JobResult:
        # One MULTI: the stored result, or else the stream's last id to wait beyond; the worker
        # writes both in one MULTI too, so nothing can slip between the two reads.
        keys = self.client.keys

        def snapshot():  # a fresh pipeline per try: execute() empties it even when it fails
            pipe = self.client.redis.pipeline(transaction=True)
            pipe.hmget(keys.job(self.id), "result", "error")
            pipe.xrevrange(keys.events(self.id), count=1)
            return pipe.execute()

        watch = self._watch(timeout, no_worker_s)  # one deadline for the snapshot and the wait
        while True:
            try:
                (res, err), last = snapshot()
                break
            except RETRY as e:  # never past the deadline (a stalled Redis: not 8 x 30 s)
                time.sleep(watch.retry_after(e))
        watch.redis_ok()
        final = terminal_from_hash(res, err) or last_terminal(last)
        if final is None:  # not finished: wait for events after the last one that exists now
            start = last[0][0] if last else "0-0"
            final = next(ev for ev in self._events(watch, start) if ev.type in TERMINAL)
        if final.type == "error" and final.code == "cancelled":
            raw = retrying(lambda: self.client.redis.xrange(keys.events(self.id)))
            return cancelled_result(self.id, final, raw)
        return final_result(self.id, final, raise_on_error=False)

    def cancel(self) -> None:
        self.client.cancel(self.id)

    def info(self) -> dict:
        return self.client.redis.hgetall(self.client.keys.job(self.id))
