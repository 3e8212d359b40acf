"""The worker's reads of its lane streams: one pipelined round trip per step while busy, one
bounded blocking read while idle.

`Worker.poll` (workers/worker.py) decides how many entries fit; this module fetches them. Busy:
the control read, our PEL (entries peers handed us: workers/inbox.py) and FAIR_READ_LUA (READ_LUA
with tenants' fair turns: workers/fair.py) on every lane shard, in one pipeline (one per node in a
cluster). Idle: one shard's fair turns, then one XREADGROUP BLOCK over that shard's lanes, a
different shard each time.
"""
from __future__ import annotations

import redis

from genpool.schemas import LANES, Keys
from genpool.schemas.scripting import pipelined
from genpool.workers.caps import ConcurrencyCaps
from genpool.workers.fair import FAIR_READ, FairPull
from genpool.workers.inbox import Inbox
from genpool.workers.job import Entry
from genpool.workers.streams import ControlReader, entries_from, lane_budgets


class LaneReads:
    """The lane reads of one worker; `idle_reads` turns the idle reads over the shards."""

    def __init__(self, r: redis.Redis, name: str, idle_block_ms: int, control: ControlReader,
                 fair: FairPull, caps: ConcurrencyCaps, inbox: Inbox):
        self.r, self.name, self.idle_block_ms = r, name, idle_block_ms
        self.control, self.fair, self.caps, self.inbox = control, fair, caps, inbox
        self.idle_reads = 0  # idle reads so far: picks the next one's shard

    def control_and_lanes(self, keys: Keys, high: int, free: int, step: int) -> tuple:
        """The control reply and the lane streams' entries, in one pipeline round trip; the
        entries peers handed us go to the inbox on the way."""
        inbox = self.inbox.reads()
        reads = [self.control.queue_read, *inbox]
        for shard, h, f in lane_budgets(keys.lane_shards, high, free, step):
            reads.append(lambda pipe, shard=shard, h=h, f=f: self.fair.queue_read(
                pipe, keys, shard, h, f, self.caps.full))
        control, *rest = pipelined(self.r, reads, lambda pipe, q: q(pipe), [FAIR_READ],
                                   raise_errors=True)
        if inbox:
            self.inbox.receive(rest[:len(inbox)])
        return control, [stream for reply in rest[len(inbox):] for stream in reply or []]

    def blocking_read(self, keys: Keys, free: int) -> list[Entry]:
        # One BLOCK call over one shard's lanes (one hash slot, so a cluster allows it), a
        # different shard each time; COUNT applies per stream, so split the room three ways.
        shards = keys.lane_shards
        shard = self.idle_reads % shards
        lanes = keys.shard_lanes(shard)
        self.idle_reads += 1
        # tenants' sub-streams wake no blocked read: look at the shard's fair turns first, taking
        # no more than the blocking read below would (a third of the room): an idle worker that
        # took every queued job would leave its peers (and prefix routing) nothing
        n = max(1, free // len(LANES))
        entries = entries_from(pipelined(self.r, [shard], lambda pipe, k: self.fair.queue_read(
            pipe, keys, k, n, n, self.caps.full), [FAIR_READ], raise_errors=True)[0], keys)
        if entries:
            for e in entries:
                self.inbox.note(e)
            return entries
        # with routing on, a peer may hand this idle worker a job (an XCLAIM, which wakes no
        # blocked read): wait at most 50 ms between looks at our own pending entries
        block = min(self.idle_block_ms, 50) if self.inbox.enabled else self.idle_block_ms
        block = self.fair.idle_block_ms(block)  # while tenants exist, look again soon
        reply = self.r.xreadgroup(keys.group, self.name, {k: ">" for k in lanes},
                                  count=max(1, free // len(LANES)), block=max(10, block // shards))
        entries = entries_from(reply, keys)  # poll() orders by lane
        for e in entries:  # ours, not a hand-off, when the next pipeline lists our PEL
            self.inbox.note(e)
        return entries
