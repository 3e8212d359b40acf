"""Bulk helpers on the sync Client: poll many jobs in one round trip, and an ordered, bounded map.

Waiting on each job with its own blocking XREAD would need one connection per job in flight;
bulk work instead polls every in-flight job's stored result in one pipelined round trip, which
costs Redis almost nothing and keeps any number of jobs in flight on one connection.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Callable, Iterable, Optional

from genpool.schemas import JobResult
from genpool.schemas.connection import redact

from . import openai_tools
from .client import Client
from .errors import NoWorkers, no_worker_target, worker_command
from .liveness import live_workers, serving
from .protocol import build_request, last_terminal, terminal_from_hash
from .retry import retrying
from .waiting import CHECK_S, log

POLL_MIN_S, POLL_MAX_S = 0.02, 0.5


def poll_results(client: Client, job_ids: list[str], deadline: Optional[float] = None
                 ) -> tuple[dict[str, JobResult], list[str]]:
    """(finished results by id, ids Redis no longer knows: lost with a Redis restart). Redis
    is retried while it does not answer, up to `deadline` (time.monotonic()): TimeoutError."""
    if not job_ids:
        return {}, []
    keys = client.keys

    def poll():  # a fresh pipeline per try: a failed execute() empties it
        pipe = client.redis.pipeline(transaction=False)
        for jid in job_ids:
            pipe.hmget(keys.job(jid), "result", "error", "state")
        return pipe.execute()

    what = f"map: Redis at {redact(client.url)}"
    replies = retrying(poll, deadline=deadline, what=what)  # as single waits are
    done, missing = {}, []
    for jid, (res, err, state) in zip(job_ids, replies):
        final = terminal_from_hash(res, err)
        if final is not None:
            done[jid] = JobResult.from_event(jid, final)
        elif state is None:
            missing.append(jid)
    lost = []
    for jid in missing:  # no hash: the event stream may still hold the terminal event
        final = last_terminal(client.redis.xrevrange(keys.events(jid), count=1))
        if final is not None:
            done[jid] = JobResult.from_event(jid, final)
        else:
            lost.append(jid)
    return done, lost


class Poller:
    """Sleeps between polls: short while results keep arriving, backing off while none do."""

    def __init__(self) -> None:
        self.delay = POLL_MIN_S

    def wait(self, got_any: bool) -> None:
        self.delay = POLL_MIN_S if got_any else min(POLL_MAX_S, self.delay * 1.5)
        if not got_any:
            time.sleep(self.delay)


class MapWatch:
    """What map says while it waits, as Job.result does for one job (waiting.py): a warning on
    the genpool.client logger as soon as no live worker serves a model its unfinished jobs name
    (once, until one serves it), NoWorkers at `timeout` or after `no_worker_s` without one,
    TimeoutError at `timeout` while workers serve. The jobs stay queued either way."""

    def __init__(self, client: Client, timeout: Optional[float], no_worker_s: Optional[float]):
        self.client, self.timeout, self.no_worker_s = client, timeout, no_worker_s
        self.t0 = self.next_check = time.monotonic()
        self.deadline = None if timeout is None else self.t0 + timeout
        self.unserved: dict[Optional[str], float] = {}  # model -> since when nobody serves it

    def check(self, waiting: dict[Optional[str], list[str]]) -> None:
        """`waiting`: model -> ids of its jobs not finished. Raises when the wait is over."""
        now = time.monotonic()
        over = self.deadline is not None and now >= self.deadline
        if now >= self.next_check or over:  # the verdict at the deadline needs a fresh look
            self._look(waiting, now)
        prefix = self.client.keys.prefix
        for model, since in self.unserved.items():
            grace_over = self.no_worker_s is not None and now - since >= self.no_worker_s
            if waiting.get(model) and (over or grace_over):
                raise NoWorkers(waiting[model][0], model, prefix, now - self.t0)
        if over:
            raise TimeoutError(f"map: {sum(map(len, waiting.values()))} jobs not finished "
                               f"within {self.timeout:g} s (they stay queued or running)")

    def _look(self, waiting: dict[Optional[str], list[str]], now: float) -> None:
        self.next_check = now + CHECK_S
        c, prefix = self.client, self.client.keys.prefix
        live = retrying(lambda: live_workers(c.redis, c.keys), deadline=self.deadline,
                        what=f"map: Redis at {redact(c.url)}")
        for model, ids in waiting.items():
            if serving(live, model):
                if self.unserved.pop(model, None) is not None:
                    log.info("map: a live worker serves %s now", no_worker_target(model, prefix))
            elif model not in self.unserved:
                self.unserved[model] = now
                log.warning("map: %d jobs are queued, but no live worker serves %s; waiting "
                            "(start one with `%s`)", len(ids), no_worker_target(model, prefix),
                            worker_command(model, prefix))


def _as_kwargs(item: Any, common: dict) -> dict:
    kw = {"prompt": item} if isinstance(item, str) else dict(item)
    kw = {**common, **kw}
    # Fixed ids make resubmitting a job lost with a Redis restart idempotent.
    kw.setdefault("job_id", uuid.uuid4().hex)
    return kw


def map_prompts(client: Client, items: Iterable[Any], *, concurrency: int = 16,
                on_result: Optional[Callable[[int, JobResult], None]] = None,
                timeout: Optional[float] = None, no_worker_s: Optional[float] = None,
                **common: Any) -> list[JobResult]:
    """Run every item (a prompt string, or a dict of submit kwargs such as `messages`) with at
    most `concurrency` jobs in flight; results come back in input order. `common` kwargs (e.g.
    max_tokens, temperature) apply to every item unless the item sets its own; `tools` and
    `tool_choice` as in Client.submit (results carry `tool_calls`). A failed job
    yields a JobResult with `.error` set; invalid items raise ValueError before anything runs.
    No live worker for the jobs' model is logged at once (genpool.client); `timeout` (the whole
    map) and `no_worker_s` end the wait as in Job.result: NoWorkers or TimeoutError."""
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    todo = [_as_kwargs(item, common) for item in items]
    # tools applied here, once (the prepared kwargs are plain chat jobs), and read back below
    tools = [openai_tools.prepare(kw) for kw in todo]
    for kw in todo:
        build_request(**kw)  # fail fast: nothing is submitted when any item is invalid
    if len({kw["job_id"] for kw in todo}) < len(todo):
        raise ValueError("items repeat a job_id; each item needs its own")
    results: list[Optional[JobResult]] = [None] * len(todo)
    inflight: dict[str, int] = {}
    nxt, poller, watch = 0, Poller(), MapWatch(client, timeout, no_worker_s)
    while nxt < len(todo) or inflight:
        room = min(concurrency - len(inflight), len(todo) - nxt)
        if room > 0:
            for i, job in enumerate(client.submit_many(todo[nxt:nxt + room]), nxt):
                inflight[job.id] = i
            nxt += room
        done, lost = poll_results(client, list(inflight), watch.deadline)
        for jid, res in done.items():
            i = inflight.pop(jid)
            results[i] = res = openai_tools.attach(tools[i], res)
            if on_result is not None:
                on_result(i, res)
        if lost:
            client.submit_many([todo[inflight[jid]] for jid in lost])
        if inflight:
            watch.check(_by_model(todo, inflight))
        poller.wait(bool(done))
    return results  # type: ignore[return-value]


def _by_model(todo: list[dict], inflight: dict[str, int]) -> dict[Optional[str], list[str]]:
    out: dict[Optional[str], list[str]] = {}
    for jid, i in inflight.items():
        out.setdefault(todo[i].get("model"), []).append(jid)
    return out
