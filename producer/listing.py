"""Jobs by id: what `genpool jobs list` prints, and the cancelled jobs `genpool status` keeps out
of "queued" (redis only).

A lane stream holds exactly its queued entries plus those delivered and not yet acknowledged
(workers delete what they ack, docs/protocol.md), so the jobs in the lanes are read from the
streams themselves, SCAN_MAX entries per stream at most. A job cancelled while queued stays in
its lane (state `queued`, `cancel` 1) until a worker reads it and ends it without running it:
it is listed, and counted, as cancelled. A finished job is in no lane any more: those are found
by SCANning the job hashes, which costs a pass over the database's keys, so only when a
finished state is asked for.
"""
from __future__ import annotations

import json
import time
from typing import Iterable, Optional

import redis

from genpool.schemas import Keys
from genpool.schemas.keys import FINISHED_STATES, JOB_ID_RE, LANES, field_float, field_int
from genpool.schemas.tenants import known_sub_streams, queue_known

SCAN_MAX = 10_000  # entries read per lane stream, and finished jobs collected by one listing
IN_LANES = ("queued", "running", "cancelled")
FIELDS = ("state", "cancel", "lane", "worker", "attempts", "submitted_at", "finished_at")


def _s(v) -> Optional[str]:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else v


def _job_id(fields: dict) -> Optional[str]:
    raw = fields.get(b"job", fields.get("job"))
    try:
        obj = json.loads(raw) if raw is not None else None
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None  # junk: a worker dead-letters it; no job to name
    job_id = obj.get("id") if isinstance(obj, dict) else None
    # an id the protocol refuses names no job hash either: a worker dead-letters the entry
    return job_id if isinstance(job_id, str) and JOB_ID_RE.match(job_id) else None


def shown_state(h: dict) -> str:
    """The state a person means: a cancelled job no worker has read yet never runs."""
    if h.get("state") == "queued" and h.get("cancel") == "1":
        return "cancelled"
    return h.get("state") or "queued"  # no hash yet (a raw XADD): nobody claimed it


def _hashes(r, keys: Keys, ids: list[str]) -> list[dict]:
    pipe = r.pipeline(transaction=False)
    for job_id in ids:
        pipe.hmget(keys.job(job_id), *FIELDS)
    return [dict(zip(FIELDS, map(_s, vals))) for vals in (pipe.execute() if ids else [])]


def _row(job_id: str, h: dict, lane: Optional[str], now: float) -> dict:
    # anyone may have written these fields: junk reads as unknown, never an exception
    sub = field_float(h.get("submitted_at"))
    return {"id": job_id, "lane": lane or h.get("lane"), "state": shown_state(h),
            "worker": h.get("worker"), "attempts": field_int(h.get("attempts")) or 0,
            "age_s": round(now - sub, 1) if sub else None,
            "finished_at": field_float(h.get("finished_at"))}


def _entries(r, stream: str, start: str = "-") -> list[tuple[str, str]]:
    """(entry id, job id) of a lane stream's first SCAN_MAX entries from `start`."""
    out = []
    for entry_id, fields in r.xrange(stream, start, "+", count=SCAN_MAX):
        job_id = _job_id(fields)
        if job_id is not None:
            out.append((_s(entry_id), job_id))
    return out


def _order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _streams(r, keys: Keys, lane: str) -> list[str]:
    """The lane's streams: one per shard, and each tenant's sub-stream of them (fair pull)."""
    pipe = r.pipeline(transaction=False)
    queue_known(pipe, keys)
    subs = known_sub_streams(keys, pipe.execute(raise_on_error=False))
    return [*(keys.jobs(lane, shard) for shard in range(keys.lane_shards)),
            *(s for s in subs if keys.lane_of_stream(s) == lane)]


def lane_rows(r, keys: Keys, lanes: Iterable[str] = LANES) -> list[dict]:
    """Every job in the lanes (lane by lane, oldest entry first) with its state."""
    rows, now = [], time.time()
    for lane in lanes:
        entries = sorted((e for stream in _streams(r, keys, lane) for e in _entries(r, stream)),
                         key=lambda e: _order(e[0]))
        ids = [job_id for _, job_id in entries]
        rows += [_row(i, h, lane, now) for i, h in zip(ids, _hashes(r, keys, ids))]
    return rows


def finished_rows(r, keys: Keys, state: str, lanes: Iterable[str] = LANES) -> list[dict]:
    """Finished jobs in `state` (newest first), found by SCAN over the job hashes."""
    rows, now, lanes = [], time.time(), set(lanes)
    batch: list[str] = []
    for key in r.scan_iter(match=keys.job_pattern, count=1000):
        job_id = keys.job_id_of(_s(key))
        if JOB_ID_RE.match(job_id):  # the pattern also matches keys no job id makes
            batch.append(job_id)
        if len(batch) >= 500:  # one round trip per 500 hashes
            rows, batch = rows + _matching(r, keys, batch, state, lanes, now), []
            if len(rows) >= SCAN_MAX:
                break
    rows += _matching(r, keys, batch, state, lanes, now)
    return sorted(rows, key=lambda row: -(row["finished_at"] or 0))


def _matching(r, keys: Keys, ids: list[str], state: str, lanes: set, now: float) -> list[dict]:
    return [row for row in (_row(i, h, None, now) for i, h in zip(ids, _hashes(r, keys, ids)))
            if row["state"] == state and row["finished_at"] and row["lane"] in lanes]


def list_jobs(r, keys: Keys, lane: Optional[str] = None,
              state: Optional[str] = None) -> list[dict]:
    """What `genpool jobs list` shows: the jobs in the lanes (all of them, or those in `state`),
    and for a finished state the finished jobs too (a cancelled job may be either)."""
    lanes = [lane] if lane else list(LANES)
    rows = [] if state in FINISHED_STATES and state != "cancelled" else lane_rows(r, keys, lanes)
    if state is not None:
        rows = [row for row in rows if row["state"] == state]
    if state in FINISHED_STATES:
        seen = {row["id"] for row in rows}
        rows += [row for row in finished_rows(r, keys, state, lanes) if row["id"] not in seen]
    return rows


def cancelled_unread(r, keys: Keys, lanes: Iterable[str]) -> dict[str, int]:
    """{lane: jobs cancelled while queued that no worker has read yet}, among the entries after
    the group's last delivered id (those a worker has read are in `pending`)."""
    out = {lane: 0 for lane in LANES}
    for lane in lanes:
        for stream in _streams(r, keys, lane):
            ids = [job_id for _, job_id in _entries(r, stream, _after_delivered(r, keys, stream))]
            out[lane] += sum(shown_state(h) == "cancelled" for h in _hashes(r, keys, ids))
    return out


def _after_delivered(r, keys: Keys, stream: str) -> str:
    try:
        groups = r.xinfo_groups(stream)
    except redis.ResponseError:  # no stream yet: nothing was ever delivered
        return "-"
    for g in groups:
        if _s(g.get("name")) == keys.group:
            return "(" + _s(g.get("last-delivered-id"))
    return "-"
