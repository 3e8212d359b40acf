"""The batch driver: every gateway runs one; it turns batches' lines into bulk-lane jobs and their
results into output and error files. It keeps nothing of its own: all it knows is in Redis, so
any gateway takes over a batch whose driver died and goes on from where it was.

- One driver per batch at a time: a lease (`Keys.batch_lease`, BATCH_LEASE_MS), renewed as it
  works; every state write checks it (schemas/batch_scripts.py), so a driver that lost its batch
  to another writes nothing more.
- Exactly one answer per custom_id: answers go into the batch's done hash with HSETNX, and the
  files are made from that hash. A line's job id is derived from (batch id, custom_id), so a
  line submitted again after a crash has the same id, which the queue runs once.
- Which lines are submitted when: producer/batch_feed.py (a window at a time, earliest deadline
  first across batches, a prompt prefix's first line before its others).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from concurrent.futures import Executor
from typing import Callable, Optional, TypeVar

import redis

from genpool.schemas import JobResult
from genpool.schemas.batch_scripts import BATCH_ANSWER_LUA, BATCH_LEASE_LUA, BATCH_RELEASE_LUA
from genpool.schemas.batches import (
    BATCH_IN_FLIGHT,
    BATCH_LEASE_MS,
    BATCH_TICK_S,
    LIVE_BATCH,
    TERMINAL_BATCH,
    UNRUN_CODE,
    BatchView,
)
from genpool.schemas.scripting import Script

from . import batch_feed
from . import batch_lines as bl
from .aio import AsyncClient
from .batch_files import write_results
from .batch_store import BatchStore, FileStore, batch_ttl_s
from .batch_upkeep import MAX_STEP_FAILURES, STEP_FAILURES_S, Deliveries, StepFailures
from .batch_webhooks import WebhookOptions, Webhooks
from .jsonl import parse_lines
from .protocol import last_terminal, terminal_from_hash

log = logging.getLogger("genpool.gateway")
LEASE, RELEASE, ANSWER = Script(BATCH_LEASE_LUA), Script(BATCH_RELEASE_LUA), Script(BATCH_ANSWER_LUA)
CHUNK = 500  # lines per round trip
CANCEL_GRACE_S = 10.0  # a cancelled batch waits this long for its running jobs to stop
T = TypeVar("T")


class LeaseLost(Exception):
    """Another gateway drives this batch now."""


class BatchDriver:
    def __init__(self, client: AsyncClient, files: FileStore, batches: BatchStore, *,
                 lease_ms: int = BATCH_LEASE_MS, tick_s: float = BATCH_TICK_S,
                 webhook: Optional[WebhookOptions] = None, in_flight: int = BATCH_IN_FLIGHT,
                 checks: Optional[Executor] = None,
                 fail_after: tuple[int, float] = (MAX_STEP_FAILURES, STEP_FAILURES_S)):
        self.client, self.r, self.keys = client, client.redis, client.keys
        self.checks = checks  # where lines are parsed and checked (None: asyncio's default pool)
        self.files, self.batches = files, batches
        self.lease_ms, self.tick_s, self.in_flight = lease_ms, tick_s, in_flight
        self.token = uuid.uuid4().hex  # this gateway's name on the leases it holds
        self.wake = asyncio.Event()
        self.webhooks = Webhooks(self.r, self.keys, webhook, self.token) if webhook else None
        self.deliveries = Deliveries(self.webhooks, batches)  # webhooks: beside the passes
        self.failures = StepFailures(*fail_after)

    async def run(self) -> None:
        """The background loop: never ends on an error (a lost Redis, a bad record) but logs it."""
        while True:
            try:
                await self.tick()
                self.deliveries.start()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the gateway's other routes must go on
                log.exception("batch driver: a pass over the active batches failed")
            try:
                await asyncio.wait_for(self.wake.wait(), self.tick_s)
            except asyncio.TimeoutError:
                pass
            self.wake.clear()

    async def close(self) -> None:
        await self.deliveries.close()

    async def tick(self) -> None:
        active = await self.r.zrange(self.keys.batches_active, 0, -1)
        self.failures.keep_only(active)
        for bid in active:
            if await LEASE.acall(self.r, [self.keys.batch_lease(bid)], [self.token,
                                                                        self.lease_ms]) != 1:
                continue  # another gateway drives it
            try:
                await self.drive(bid)
                self.failures.ok(bid)
            except LeaseLost:
                log.info("batch %s: its lease went to another gateway", bid)
            except (asyncio.CancelledError, redis.ConnectionError, redis.TimeoutError):
                raise  # a stop, or Redis away: the whole pass waits for the next tick
            except redis.RedisError:  # (refused writes under memory pressure): not the batch's
                log.exception("batch %s: this step failed; it is tried again next pass", bid)
            except Exception as e:  # noqa: BLE001 - one batch that cannot go on must not stop others
                await self.step_failed(bid, e)

    async def step_failed(self, bid: str, err: Exception) -> None:
        """A step that keeps raising for the batch's own reasons (StepFailures) ends the batch
        `failed`, saying why, with its jobs cancelled, rather than leaving it in its state for
        good (not cancellable, not expiring)."""
        if not self.failures.failed(bid):
            log.exception("batch %s: this step failed; it is tried again next pass", bid)
            return
        log.exception("batch %s: its step keeps failing; the batch fails", bid)
        why = [{"code": "batch_step_failed",
                "message": f"the batch could not go on: {type(err).__name__}: {err}"[:1000]}]
        try:
            if await self.move(bid, LIVE_BATCH, "failed", "failed_at", errors=json.dumps(why)):
                for jid in await self.r.smembers(self.keys.batch_sent(bid)):
                    await self.client.cancel(jid)  # nobody will collect them
                await self.retire(bid, True)
        except LeaseLost:
            log.info("batch %s: its lease went to another gateway", bid)

    async def renew(self, bid: str) -> None:
        if await LEASE.acall(self.r, [self.keys.batch_lease(bid)],
                             [self.token, self.lease_ms]) != 1:
            raise LeaseLost(bid)

    async def drive(self, bid: str) -> None:
        """One step of one batch, from whatever state Redis holds."""
        view = await self.batches.get(bid)
        if view is None or view.status in TERMINAL_BATCH:
            await self.retire(bid, view is not None)
            return
        if view.status in ("validating", "in_progress") and time.time() >= view.record.expires_at:
            await self.expire(bid, view)
        elif view.status == "validating":
            await self.validate(bid, view)
        elif view.status == "in_progress":
            await self.collect(bid, view)
            await batch_feed.feed(self, bid, view, self.in_flight)
            if not await self.r.hlen(self.keys.batch_lines(bid)):
                await self.move(bid, ("in_progress",), "finalizing", "finalizing_at")
                await self.finish(bid, view, "completed")
        elif view.status == "finalizing":
            await self.finish(bid, view, "completed")
        elif view.status == "cancelling":
            await self.cancelling(bid, view)

    async def validate(self, bid: str, view: BatchView) -> None:
        if await batch_feed.expand(self, bid, view):
            await self.move(bid, ("validating",), "in_progress", "in_progress_at")
            return
        await self.move(bid, ("validating",), "failed", "failed_at", errors=json.dumps(
            [{"code": "input_file_missing", "message": f"the input file "
              f"{view.record.input_file_id} was deleted before the batch ran"}]))
        await self.retire(bid, True)

    async def move(self, bid: str, leave: tuple, to: str, stamp: str, **fields) -> bool:
        moved, _ = await self.batches.move(bid, self.token, leave, to, stamp, **fields)
        if moved < 0:
            raise LeaseLost(bid)
        return moved == 1

    async def answer(self, bid: str, cid: str, lineno: int, ok: bool, line: dict,
                     job_id: str, ttl_s: int) -> None:
        k = self.keys
        got = await ANSWER.acall(self.r, [k.batch_lease(bid), k.batch(bid), k.batch_done(bid),
                                          k.batch_lines(bid), k.batch_todo(bid),
                                          k.batch_sent(bid)],
                                 [self.token, cid, bl.stored(lineno, ok, line),
                                  "completed" if ok else "failed", job_id, ttl_s])
        if got == -1:
            raise LeaseLost(bid)

    async def off_loop(self, fn: Callable[..., T], *args, bid: Optional[str] = None) -> T:
        """fn(*args) on the check threads: a batch's lines are parsed and checked there, so a
        big file does not stall the gateway's streams while it does. With `bid`, the batch's
        lease is renewed meanwhile (50,000 lines of schemas take longer than the lease)."""
        work = asyncio.get_running_loop().run_in_executor(self.checks, fn, *args)
        while bid is not None:
            done, _ = await asyncio.wait({work}, timeout=self.lease_ms / 3000)
            if done:
                break
            await self.renew(bid)
        return await work

    async def input_lines(self, view: BatchView):
        """(line number, parsed object) of each line of the batch's input (None: deleted)."""
        text = await self.files.content(view.record.input_file_id)
        if text is None:
            return None
        return await self.off_loop(parse_lines, text)

    async def collect(self, bid: str, view: BatchView) -> list[str]:
        """Answer every submitted line whose job ended; returns the job ids still running. Only
        the job ids are read each pass: a line's input is read when its job has ended."""
        ids = list(await self.r.smembers(self.keys.batch_sent(bid)))
        ttl, lost = batch_ttl_s(view.record), []
        ended: set[str] = set()
        for i in range(0, len(ids), CHUNK):
            chunk = ids[i:i + CHUNK]
            results = dict(zip(chunk, await self.poll(chunk)))
            now = [j for j in chunk if results[j] is not None]
            for jid, line in zip(now, await self.lines_of(bid, now)):
                if line is None:
                    continue  # answered meanwhile (a driver before this one)
                if results[jid] is False:
                    lost.append(line)
                    continue
                ended.add(jid)
                ok, out = bl.finished(jid, line["obj"], view.record, results[jid])
                await self.answer(bid, line["obj"]["custom_id"], line["n"], ok, out, jid, ttl)
            await self.renew(bid)
        if lost:  # Redis lost their jobs (a restart without persistence): same ids again
            log.warning("batch %s: resubmitting %d jobs Redis no longer knows", bid, len(lost))
            await self.client.submit_many([bl.parse_line_body(x["obj"], view.record).kwargs
                                           for x in lost])
        return [j for j in ids if j not in ended]

    async def lines_of(self, bid: str, job_ids: list[str]) -> list[Optional[dict]]:
        """The input lines ({n, obj}) of these jobs (None for one answered already)."""
        if not job_ids:
            return []
        raw = await self.r.hmget(self.keys.batch_lines(bid), job_ids)
        return [json.loads(x) if x else None for x in raw]

    async def poll(self, job_ids: list[str]) -> list:
        """Per job: its JobResult when it ended, None while it runs, False when Redis lost it."""
        pipe = self.r.pipeline(transaction=False)
        for jid in job_ids:
            pipe.hmget(self.keys.job(jid), "result", "error", "state")
        out: list = []
        for jid, (res, err, state) in zip(job_ids, await pipe.execute()):
            final = terminal_from_hash(res, err)
            if final is None and state is None:  # no hash: the stream may still say how it ended
                final = last_terminal(await self.r.xrevrange(self.keys.events(jid), count=1))
                out.append(JobResult.from_event(jid, final) if final else False)
            else:
                out.append(JobResult.from_event(jid, final) if final else None)
        return out

    async def stop_lines(self, bid: str, view: BatchView, job_ids: list[str],
                         code: str) -> None:
        """Cancel these lines' jobs (those submitted) and answer them `code` (a job that ends
        anyway is ignored: its custom_id is answered already)."""
        ttl = batch_ttl_s(view.record)
        sent = await self.r.smembers(self.keys.batch_sent(bid))
        for jid, line in zip(job_ids, await self.lines_of(bid, job_ids)):
            if jid in sent:
                await self.client.cancel(jid)
            if line is not None:
                cid = line["obj"]["custom_id"]
                await self.answer(bid, cid, line["n"], False, bl.unrun(jid, cid, code), jid, ttl)

    async def expire(self, bid: str, view: BatchView) -> None:
        """Past the window: keep what finished, end the rest as batch_expired."""
        await self.collect(bid, view)
        await self.stop_lines(bid, view, await self.r.hkeys(self.keys.batch_lines(bid)),
                              "batch_expired")
        await self.finish(bid, view, "expired")

    async def cancelling(self, bid: str, view: BatchView) -> None:
        """Cancel every job once; queued ones are answered at once, running ones get a grace to
        stop (their results, if they finish first, are kept)."""
        k = self.keys
        sent = await self.r.hget(k.batch(bid), "cancel_sent")
        if sent is None:
            for jid in await self.r.smembers(k.batch_sent(bid)):
                await self.client.cancel(jid)
            sent = f"{time.time():.3f}"
            await self.r.hset(k.batch(bid), "cancel_sent", sent)
        waiting = await self.collect(bid, view)
        late = time.time() - float(sent) > CANCEL_GRACE_S
        states = await self.job_states(waiting)
        never = await self.r.zrange(k.batch_todo(bid), 0, -1)  # lines never submitted
        await self.stop_lines(bid, view, never + [j for j in waiting
                                                  if late or states[j] != "running"],
                              "batch_cancelled")
        if not await self.r.hlen(k.batch_lines(bid)):
            await self.finish(bid, view, "cancelled")

    async def job_states(self, job_ids: list[str]) -> dict[str, Optional[str]]:
        pipe = self.r.pipeline(transaction=False)
        for jid in job_ids:
            pipe.hget(self.keys.job(jid), "state")
        return dict(zip(job_ids, await pipe.execute()))

    async def finish(self, bid: str, view: BatchView, final: str) -> None:
        """Answer lines that never ran (cancel, expiry), write the files, end the batch."""
        code = UNRUN_CODE.get(final)  # None: every line has its answer already
        lines = await self.input_lines(view) if code else []
        gone = {}
        if lines is None:  # deleted before the batch expanded: its lines cannot be named
            lines, gone = [], {"errors": json.dumps([{"code": "input_file_missing", "message": (
                f"the input file {view.record.input_file_id} was deleted before the batch "
                f"ran; none of its {view.total} lines ran")}])}
        done = set(await self.r.hkeys(self.keys.batch_done(bid))) if code else set()
        for n, obj in lines:
            if obj["custom_id"] not in done:
                jid = bl.line_job_id(bid, obj["custom_id"])
                await self.answer(bid, obj["custom_id"], n, False,
                                  bl.unrun(jid, obj["custom_id"], code), jid,
                                  batch_ttl_s(view.record))
        await self.renew(bid)
        ids = await write_results(self.r, self.keys, self.files, view, self)
        leave = {"completed": ("finalizing",), "cancelled": ("cancelling",),
                 "expired": ("validating", "in_progress")}[final]
        if await self.move(bid, leave, final, f"{final}_at", **ids, **gone):
            await self.retire(bid, True)
        # else a cancel came first: the next pass ends the batch as cancelled (same files' ids)

    async def retire(self, bid: str, ended: bool) -> None:
        """The batch is over (`ended`: it exists and reached its final state): no driver looks
        at it again, and its webhook event is due (once: notify is idempotent)."""
        if ended and self.webhooks is not None:
            await self.webhooks.notify(bid)
        await self.r.zrem(self.keys.batches_active, bid)
        await RELEASE.acall(self.r, [self.keys.batch_lease(bid)], [self.token])
