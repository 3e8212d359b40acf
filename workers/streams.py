"""Consumer-side Redis stream plumbing: groups, reading entries, claiming and reclaiming."""
from __future__ import annotations

import logging
from typing import Iterable

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


# Read new entries lane by lane in ONE round trip, never more than the worker can hold: the high
# lane up to ARGV[3] (it may exceed capacity so interactive work can preempt), then normal, then
# low, sharing what is left of ARGV[4]. (Separate XREADGROUPs would need one round trip each, and
# one multi-stream XREADGROUP applies COUNT per stream, over-pulling.)
# KEYS: high, normal, low lane streams; ARGV: group, consumer, high count, capacity.
READ_LUA = """
local out, free = {}, tonumber(ARGV[4])
local function take(key, n)
  if n <= 0 then return 0 end
  local r = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', n, 'STREAMS', key, '>')
  if not r then return 0 end
  table.insert(out, r[1])
  return #r[1][2]
end
free = free - take(KEYS[1], tonumber(ARGV[3]))
free = free - take(KEYS[2], free)
take(KEYS[3], free)
return out
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
    """XREAD(GROUP)-shaped reply -> Entry objects (entries deleted meanwhile come back empty).
    READ_LUA's reply has the same shape, with fields as flat [k, v, k, v, ...] lists."""
    out = []
    for stream, items in reply or []:
        stream = s(stream)
        for entry_id, fields in items:
            if fields is None:  # deleted after delivery; nothing left to run
                continue
            if isinstance(fields, list):
                fields = dict(zip(fields[0::2], fields[1::2]))
            out.append(Entry(stream, keys.lane_of_stream(stream), s(entry_id), fields, deliveries))
    return out


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


class ControlReader:
    """Follows the broadcast control stream (every worker sees every cancel) with XREAD."""

    def __init__(self, keys: Keys):
        self.keys, self.cursor = keys, "0-0"

    def start_at_tail(self, r: redis.Redis) -> None:
        # Cancels sent before this worker existed are covered by the job hash's cancel flag.
        last = r.xrevrange(self.keys.control, count=1)
        self.cursor = last[0][0] if last else "0-0"

    def queue_read(self, pipe) -> None:
        pipe.xread({self.keys.control: self.cursor}, count=1000)

    def read(self, r: redis.Redis) -> list[str]:
        return self.cancels(r.xread({self.keys.control: self.cursor}, count=1000))

    def cancels(self, reply) -> list[str]:
        """Job ids to cancel from an XREAD reply; advances the cursor."""
        ids = []
        for _, items in reply or []:
            for entry_id, fields in items:
                self.cursor = entry_id
                if fields.get(b"op") == b"cancel" and fields.get(b"id"):
                    ids.append(fields[b"id"].decode("utf-8", "replace"))
        return ids
