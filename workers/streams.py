"""Consumer-side Redis stream plumbing: groups, reading entries, claiming and reclaiming."""
from __future__ import annotations

import logging
from typing import Iterable, Optional

import redis

from schemas import LANES, Keys

from .intake import Entry

log = logging.getLogger("genpool.worker")

# Decide, atomically per job, whether this worker may run an entry. It guards the "a job id runs
# once" rule for producers that XADD directly (without the submit script): the first entry to
# claim a job id owns it, and any other entry with the same id is a duplicate.
# KEYS[1] job hash; ARGV: entry id, worker name, now, TTL seconds, mode ("run" or "check").
# Returns {verdict, detail}: run/attempt-number, duplicate/owner-entry, finished/state, cancelled.
CLAIM_LUA = """
local owner = redis.call('HGET', KEYS[1], 'entry')
if owner and owner ~= ARGV[1] then return {'duplicate', owner} end
local state = redis.call('HGET', KEYS[1], 'state')
if state and state ~= 'queued' and state ~= 'running' then return {'finished', state} end
if not owner then redis.call('HSET', KEYS[1], 'entry', ARGV[1]) end
if redis.call('TTL', KEYS[1]) < 0 then redis.call('EXPIRE', KEYS[1], ARGV[4]) end
if ARGV[5] ~= 'run' then return {'check', ''} end
if redis.call('HGET', KEYS[1], 'cancel') == '1' then return {'cancelled', ''} end
redis.call('HSET', KEYS[1], 'state', 'running', 'worker', ARGV[2], 'started_at', ARGV[3])
return {'run', tostring(redis.call('HINCRBY', KEYS[1], 'attempts', 1))}
"""


def ensure_groups(r: redis.Redis, keys: Keys) -> None:
    """Create the consumer group on every lane (and the stream itself) if missing."""
    for lane in LANES:
        try:
            r.xgroup_create(keys.jobs(lane), keys.group, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise


def s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def entries_from(reply, keys: Keys, deliveries: int = 1) -> list[Entry]:
    """XREAD(GROUP)-shaped reply -> Entry objects (entries deleted meanwhile come back empty)."""
    out = []
    for stream, items in reply or []:
        stream = s(stream)
        for entry_id, fields in items:
            if fields is None:  # deleted after delivery; nothing left to run
                continue
            out.append(Entry(stream, keys.lane_of_stream(stream), s(entry_id), fields, deliveries))
    return out


def read_lanes(pipe, keys: Keys, worker: str, counts: dict[str, int],
               block_ms: Optional[int] = None) -> None:
    """Queue one XREADGROUP per lane with a positive count on `pipe` (or client)."""
    for lane in LANES:
        if counts.get(lane, 0) > 0:
            pipe.xreadgroup(keys.group, worker, {keys.jobs(lane): ">"}, count=counts[lane],
                            block=block_ms)


def refresh_claims(r: redis.Redis, keys: Keys, worker: str, entries: Iterable[Entry]) -> None:
    """Reset the idle time of entries this worker is still running, so no one reclaims them.
    JUSTID: the delivery counter is not incremented."""
    by_stream: dict[str, list[str]] = {}
    for e in entries:
        by_stream.setdefault(e.stream, []).append(e.entry_id)
    if not by_stream:
        return
    pipe = r.pipeline(transaction=False)
    for stream, ids in by_stream.items():
        pipe.xclaim(stream, keys.group, worker, 0, ids, justid=True)
    pipe.execute()


def reclaim(r: redis.Redis, keys: Keys, worker: str, min_idle_ms: int, limit: int,
            cursors: dict[str, str]) -> list[Entry]:
    """XAUTOCLAIM entries idle longer than `min_idle_ms` (their worker is presumed dead), with
    each entry's delivery count (which the claim incremented)."""
    claimed: list[Entry] = []
    for lane in LANES:
        if len(claimed) >= limit:
            break
        stream = keys.jobs(lane)
        reply = r.xautoclaim(stream, keys.group, worker, min_idle_ms,
                             start_id=cursors.get(lane, "0-0"), count=limit - len(claimed))
        cursors[lane] = s(reply[0])
        claimed += entries_from([(stream, reply[1])], keys)
    if claimed:
        pipe = r.pipeline(transaction=False)
        for e in claimed:
            pipe.xpending_range(e.stream, keys.group, e.entry_id, e.entry_id, 1)
        for e, info in zip(claimed, pipe.execute()):
            e.deliveries = int(info[0]["times_delivered"]) if info else 1
    return claimed


def own_pending(r: redis.Redis, keys: Keys, worker: str, limit: int) -> list[Entry]:
    """Entries a previous run under this same worker name left unacknowledged."""
    out: list[Entry] = []
    for lane in LANES:
        stream = keys.jobs(lane)
        pend = r.xpending_range(stream, keys.group, "-", "+", limit, consumername=worker)
        if not pend:
            continue
        ids = [p["message_id"] for p in pend]
        counts = {s(p["message_id"]): int(p["times_delivered"]) + 1 for p in pend}
        got = entries_from([(stream, r.xclaim(stream, keys.group, worker, 0, ids))], keys)
        for e in got:
            e.deliveries = counts.get(e.entry_id, 2)
        out += got
    return out
