"""The receiving side of prefix-aware routing: entries peers handed this worker.

A peer hands a job over by moving the entry's PENDING record to our consumer name (see
workers/router.py), which wakes no blocked read and writes no stream of ours. So the worker looks
at its own PEL (XPENDING ... <its name>, in the same pipeline as its lane reads) and tells a
hand-off from an entry it read or reclaimed itself by remembering the entries it has held
(`note`). A hand-off is held at once (so its idle time stays fresh while we live) and queued as
the backlog, which `take` admits as capacity frees, interactive entries first. Entries that
arrived this way are marked origin="handed" and never routed again, so no job moves twice.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from functools import partial
from typing import Any, Callable

import redis

from genpool.schemas import LANES, Keys
from genpool.schemas.keys import field_text
from genpool.schemas.scripting import pipelined
from genpool.workers.job import Entry
from genpool.workers.lease import LeaseKeeper
from genpool.workers.streams import entries_from

SEEN_CAP = 65536  # entry ids a worker remembers having held (so its own are never "handed")


class Inbox:
    """Find, hold and queue the entries peers handed us; admit them as capacity frees."""

    def __init__(self, r: redis.Redis, keeper: LeaseKeeper, name: str, enabled: bool,
                 keys: Callable[[], Keys], counts: dict[str, int]):
        self.r, self.keeper, self.name, self.enabled = r, keeper, name, enabled
        self._keys = keys  # the worker's keys now: a reconnect may widen the lane shards
        self.counts = counts  # the router's counters: handed_in is counted here
        self.backlog: deque[Entry] = deque()  # handed to us, held, waiting for capacity
        self._seen: OrderedDict[tuple[str, str], None] = OrderedDict()

    def note(self, e: Entry) -> None:
        """An entry this worker holds (read, reclaimed): never mistake it for a hand-off."""
        self._seen[(e.stream, e.entry_id)] = None
        if len(self._seen) > SEEN_CAP:
            self._seen.popitem(last=False)

    def reads(self) -> list[Callable[[Any], None]]:
        """The PEL reads, one command each, to queue BEFORE the lane reads of the same pipeline
        (so entries that pipeline reads fresh are not in them); their replies go to receive()."""
        if not self.enabled:
            return []
        keys = self._keys()
        return [partial(_pending_of, stream=stream, group=keys.group, name=self.name)
                for stream in keys.all_jobs()]

    def receive(self, replies: list) -> None:
        """Hold the entries peers handed us (pending for us, never held by us)."""
        keeper, new, keys = self.keeper, [], self._keys()
        for stream, pend in zip(keys.all_jobs(), replies):
            for p in pend or []:
                eid = field_text(p["message_id"])
                if (stream, eid) in self._seen:
                    continue
                new.append((stream, eid, int(p["times_delivered"])))
        if not new:
            return
        pipe = self.r.pipeline(transaction=False)
        for stream, eid, _ in new:
            pipe.xrange(stream, min=eid, max=eid, count=1)
        for (stream, eid, times), got in zip(new, pipe.execute()):
            for e in entries_from([(stream, got)], keys, deliveries=max(1, times)):
                if keeper.holds(e):
                    continue
                e.origin = "handed"
                keeper.hold(e)
                self.note(e)
                self.backlog.append(e)
                self.counts["handed_in"] += 1
            self.note(Entry(stream, "", eid, {}))  # deleted meanwhile: do not look again

    def read_now(self) -> None:
        if not self.enabled:
            return
        reads = self.reads()
        if reads:
            self.receive(pipelined(self.r, reads, _call, raise_errors=True))

    def take(self, n: int, high_burst: int = 0) -> list[Entry]:
        """Up to n backlog entries to admit now, interactive ones first; interactive ones also
        beyond n, up to `high_burst` (as the high lane is read: the engine preempts for them, so
        one handed over on a stale view of our free slots still never waits for a slot)."""
        if not self.backlog:
            return []
        order = sorted(self.backlog, key=lambda e: LANES.index(e.lane))
        out, rest = [], []
        for e in order:
            room = max(n, 0) + (high_burst if e.lane == "high" else 0)
            (out if len(out) < room else rest).append(e)
        self.backlog = deque(rest)
        return out


def _pending_of(pipe, stream: str, group: str, name: str) -> None:
    pipe.xpending_range(stream, group, "-", "+", 512, consumername=name)


def _call(pipe, queue) -> None:
    queue(pipe)
