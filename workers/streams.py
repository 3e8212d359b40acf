"""Consumer-side Redis stream plumbing: groups, reading entries, claiming and reclaiming, and
telling a refused write from a lost connection."""
from __future__ import annotations

import logging
from typing import Sequence

import redis

from genpool.schemas import Keys
from genpool.schemas.keys import MAX_LANE_SHARDS, META_TTL_S, check_memory_policy, field_text
from genpool.schemas.scripting import Script
from genpool.schemas.scripts import SHARDS_LUA
from genpool.workers.job import Entry

log = logging.getLogger("genpool.worker")


SHARDS = Script(SHARDS_LUA)

# Error replies of a live server that takes no writes for now: memory pressure under noeviction
# (OOM), too few replicas (NOREPLICAS), a replica or a demoted master (READONLY), a failed save
# with stop-writes-on-bgsave-error (MISCONF). A refused command wrote nothing, a refused script
# too (Redis refuses a script at its first write, never after it began), so what was refused is
# sent again as it was. Scripts' refusals come back wrapped: "Error running script ...: -OOM ..."
# on Redis 6.2, "OOM ... script: ..." on 7.
REFUSALS = ("OOM", "NOREPLICAS", "READONLY", "MISCONF")


class WritesRefused(redis.ResponseError):
    """Redis refused some of this step's writes; they are queued again (raised so the loop
    waits a moment before it tries again, as it would for a lost connection)."""


def refused(x) -> bool:
    """Whether a reply (an exception object or anything else) is a refused write."""
    if isinstance(x, (WritesRefused, redis.exceptions.OutOfMemoryError,
                      redis.exceptions.ReadOnlyError)):
        return True
    if not isinstance(x, redis.ResponseError):
        return False
    # a raised pipeline error quotes the command (client data) first: judge the reply only
    reply = str(x).rsplit("of pipeline caused error: ", 1)[-1]
    return reply.startswith(REFUSALS) or any(f": -{code} " in reply for code in REFUSALS)


def publish_shards(r, keys: Keys) -> Keys:
    """Record this worker's --lane-shards (never lowering it); Keys for every shard to read.
    Run at every start and reconnect, so it first checks the server's maxmemory-policy (a
    failover may bring another server): any but noeviction loses jobs (schemas/keys.py)."""
    check_memory_policy(r, log)
    n = int(SHARDS(r, [keys.meta], [keys.lane_shards, META_TTL_S, MAX_LANE_SHARDS]))
    if n != keys.lane_shards:
        log.warning("lane shards: this worker was started with %d but the deployment has %d; "
                    "reading all %d", keys.lane_shards, n, n)
    return keys.with_shards(n)


def lane_budgets(shards: int, high: int, free: int, turn: int) -> list[tuple[int, int, int]]:
    """(shard, high-lane count, capacity) for each lane shard read this step: both split evenly,
    the remainders going to the shards first in an order that rotates by one every step, so no
    shard waits longer than `shards` steps for room. Shards given nothing are skipped."""
    out = []
    for i in range(shards):
        h = high // shards + (i < high % shards)
        f = free // shards + (i < free % shards)
        if h or f:
            out.append(((turn + i) % shards, h, f))
    return out


def ensure_groups(r: redis.Redis, keys: Keys) -> None:
    """Create the consumer group on every lane of every shard (and the stream) if missing."""
    for stream in keys.all_jobs():
        try:
            r.xgroup_create(stream, keys.group, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise


def entries_from(reply, keys: Keys, deliveries: int = 1) -> list[Entry]:
    """XREAD(GROUP)-shaped reply -> Entry objects (entries deleted meanwhile come back empty).
    READ_LUA's reply has the same shape, with fields as flat [k, v, k, v, ...] lists."""
    out = []
    for stream, items in reply or []:
        stream = field_text(stream)
        for entry_id, fields in items:
            if fields is None:  # deleted after delivery; nothing left to run
                continue
            if isinstance(fields, list):
                fields = dict(zip(fields[0::2], fields[1::2]))
            out.append(Entry(stream, keys.lane_of_stream(stream), field_text(entry_id), fields,
                             deliveries))
    return out


def reclaim(r: redis.Redis, keys: Keys, worker: str, min_idle_ms: int, limit: int,
            sub_streams: Sequence[str] = ()) -> list[Entry]:
    """Up to `limit` entries idle longer than `min_idle_ms` (their worker is presumed dead),
    oldest first, with each entry's delivery count (the claim's included). One pipelined
    `XPENDING ... IDLE` finds them, wherever they sit in a long pending list (usually none: one
    round trip in all); `XCLAIM` with the same idle bound takes them, so of two workers that
    found the same entry only one gets it. `sub_streams`: the tenants' (workers/fair.py)."""
    streams = [*keys.all_jobs(), *sub_streams]
    probe = r.pipeline(transaction=False)
    for stream in streams:
        probe.xpending_range(stream, keys.group, "-", "+", limit, idle=min_idle_ms)
    claimed: list[Entry] = []
    for stream, idle in zip(streams, probe.execute(raise_on_error=False)):
        if isinstance(idle, Exception):
            if stream in sub_streams:  # a sub-stream deleted (or its group) holds nothing
                continue
            raise idle
        claimed += _claim(r, keys, stream, worker, min_idle_ms, idle[:limit - len(claimed)])
    return claimed


def _claim(r: redis.Redis, keys: Keys, stream: str, worker: str, min_idle_ms: int,
           pending: list[dict]) -> list[Entry]:
    """XCLAIM these XPENDING rows for `worker`, each entry with its delivery count (the claim's
    included); entries deleted meanwhile, or taken by another claimer first, are left out."""
    if not pending:
        return []
    counts = {field_text(p["message_id"]): int(p["times_delivered"]) + 1 for p in pending}
    got = entries_from([(stream, r.xclaim(stream, keys.group, worker, min_idle_ms,
                                          [p["message_id"] for p in pending]))], keys)
    for e in got:
        e.deliveries = counts.get(e.entry_id, 2)
    return got


def own_pending(r: redis.Redis, keys: Keys, worker: str, limit: int,
                sub_streams: Sequence[str] = ()) -> list[Entry]:
    """Entries a previous run under this same worker name left unacknowledged."""
    out: list[Entry] = []
    for stream in [*keys.all_jobs(), *sub_streams]:
        try:
            pend = r.xpending_range(stream, keys.group, "-", "+", limit, consumername=worker)
        except redis.ResponseError:
            if stream in sub_streams:  # NOGROUP: a deleted sub-stream holds nothing
                continue
            raise
        out += _claim(r, keys, stream, worker, 0, pend)
    return out


class ControlReader:
    """Follows the broadcast control stream (every worker sees every cancel) with XREAD."""

    def __init__(self, keys: Keys):
        self.keys, self.cursor = keys, "0-0"

    def start_at_tail(self, r: redis.Redis) -> None:
        # Cancels sent before this worker existed are covered by the job hash's cancel flag.
        last = r.xrevrange(self.keys.control, count=1)
        self.cursor = field_text(last[0][0]) if last else "0-0"

    # XRANGE from just after the cursor, not XREAD: the same entries, but a fixed key position,
    # so a cluster client routes it without asking a node COMMAND GETKEYS first.
    def queue_read(self, pipe) -> None:
        pipe.xrange(self.keys.control, min=f"({self.cursor}", max="+", count=1000)

    def read(self, r: redis.Redis) -> list[str]:
        return self.cancels(r.xrange(self.keys.control, min=f"({self.cursor}", max="+",
                                     count=1000))

    def cancels(self, entries) -> list[str]:
        """Job ids to cancel from an XRANGE reply; advances the cursor."""
        ids = []
        for entry_id, fields in entries or []:
            self.cursor = field_text(entry_id)
            if fields.get(b"op") == b"cancel" and fields.get(b"id"):
                ids.append(fields[b"id"].decode("utf-8", "replace"))
        return ids
