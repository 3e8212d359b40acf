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

from .client import Client, _retrying
from .protocol import build_request, last_terminal, terminal_from_hash

POLL_MIN_S, POLL_MAX_S = 0.02, 0.5


def poll_results(client: Client, job_ids: list[str]) -> tuple[dict[str, JobResult], list[str]]:
    """(finished results by id, ids Redis no longer knows: lost with a Redis restart)."""
    if not job_ids:
        return {}, []
    keys = client.keys

    def poll():  # a fresh pipeline per try: a failed execute() empties it
        pipe = client.redis.pipeline(transaction=False)
        for jid in job_ids:
            pipe.hmget(keys.job(jid), "result", "error", "state")
        return pipe.execute()

    replies = _retrying(poll)  # a slow or restarting Redis is retried, as single waits are
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


def _as_kwargs(item: Any, common: dict) -> dict:
    kw = {"prompt": item} if isinstance(item, str) else dict(item)
    kw = {**common, **kw}
    # Fixed ids make resubmitting a job lost with a Redis restart idempotent.
    kw.setdefault("job_id", uuid.uuid4().hex)
    return kw


def map_prompts(client: Client, items: Iterable[Any], *, concurrency: int = 16,
                on_result: Optional[Callable[[int, JobResult], None]] = None,
                **common: Any) -> list[JobResult]:
    """Run every item (a prompt string, or a dict of submit kwargs such as `messages`) with at
    most `concurrency` jobs in flight; results come back in input order. `common` kwargs (e.g.
    max_tokens, temperature) apply to every item unless the item sets its own. A failed job
    yields a JobResult with `.error` set; invalid items raise ValueError before anything runs."""
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    todo = [_as_kwargs(item, common) for item in items]
    for kw in todo:
        build_request(**kw)  # fail fast: nothing is submitted when any item is invalid
    if len({kw["job_id"] for kw in todo}) < len(todo):
        raise ValueError("items repeat a job_id; each item needs its own")
    results: list[Optional[JobResult]] = [None] * len(todo)
    inflight: dict[str, int] = {}
    nxt, poller = 0, Poller()
    while nxt < len(todo) or inflight:
        room = min(concurrency - len(inflight), len(todo) - nxt)
        if room > 0:
            for i, job in enumerate(client.submit_many(todo[nxt:nxt + room]), nxt):
                inflight[job.id] = i
            nxt += room
        done, lost = poll_results(client, list(inflight))
        for jid, res in done.items():
            i = inflight.pop(jid)
            results[i] = res
            if on_result is not None:
                on_result(i, res)
        if lost:
            client.submit_many([todo[inflight[jid]] for jid in lost])
        poller.wait(bool(done))
    return results  # type: ignore[return-value]
