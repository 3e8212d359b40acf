"""Queue depth per lane, pending (in flight), cancelled while queued, workers and their
heartbeats, dead letters."""
from __future__ import annotations

import time

import redis

from genpool.schemas import Keys
from genpool.schemas.connection import lane_depths, queue_lane_depths
from genpool.schemas.keys import field_text
from genpool.schemas.tenants import known_sub_streams, queue_known

from .listing import cancelled_unread
from .liveness import read_infos


def _lane_status(r: redis.Redis, keys: Keys) -> tuple[dict, dict]:
    """({lane: queued, pending}, {lane: cancelled}): a job cancelled while queued stays in its
    lane until a worker drops it, but it will never run, so it is not counted as queued."""
    pipe = r.pipeline(transaction=False)
    queue_known(pipe, keys)  # tenants' sub-streams (fair pull) hold queued jobs too
    subs = known_sub_streams(keys, pipe.execute(raise_on_error=False))
    pipe = r.pipeline(transaction=False)
    queue_lane_depths(pipe, keys, subs)
    depths = lane_depths(pipe.execute(raise_on_error=False), [keys.lane_of_stream(s) for s in subs])
    cancelled = cancelled_unread(r, keys, [lane for lane, (q, _) in depths.items() if q])
    return ({lane: {"queued": max(0, queued - cancelled[lane]), "pending": pending}
             for lane, (queued, pending) in depths.items()}, cancelled)


def _worker_status(r: redis.Redis, keys: Keys) -> tuple[list[dict], list[dict]]:
    """(every known worker whose document parses, with `alive` and `beat_age_s`; the others,
    each {"name", "why"}): a junk entry in the workers hash is shown, never fatal."""
    good, bad = read_infos(r.hgetall(keys.workers))
    names = sorted(good)
    pipe = r.pipeline(transaction=False)
    for name in names:
        pipe.exists(keys.worker(name))
    alive = pipe.execute() if names else []
    now = time.time()
    workers = [{**good[name].model_dump(), "alive": bool(up),
                "beat_age_s": round(now - good[name].beat, 1) if good[name].beat else None}
               for name, up in zip(names, alive)]
    return workers, [{"name": name, "why": why} for name, why in sorted(bad.items())]


def queue_status(r: redis.Redis, keys: Keys, dead_tail: int = 5) -> dict:
    """`r` should not decode responses: dead letters may hold any bytes a client XADDed."""
    dead = r.xrevrange(keys.dead, count=dead_tail)
    lanes, cancelled = _lane_status(r, keys)
    workers, unreadable = _worker_status(r, keys)
    return {
        "prefix": keys.prefix,
        "lanes": lanes,
        "cancelled": cancelled,  # per lane: cancelled while queued, not yet dropped by a worker
        "workers": workers,
        "unreadable_workers": unreadable,  # workers hash entries that do not parse (WorkerInfo)
        "dead": {"count": r.xlen(keys.dead),
                 "recent": [letter(i, f) for i, f in dead]},
    }


def format_status(st: dict) -> str:
    lines = [f"prefix {st['prefix']}", "lane     queued  pending  cancelled"]
    for lane, d in st["lanes"].items():
        lines.append(f"{lane:<8} {d['queued']:>6}  {d['pending']:>7}  "
                     f"{st.get('cancelled', {}).get(lane, 0):>9}")
    lines.append(f"workers: {sum(w['alive'] for w in st['workers'])} alive"
                 f" / {len(st['workers'])} known")
    for w in st["workers"]:
        state = "alive" if w["alive"] else "gone "
        lines.append(f"  {w['name']:<24} {state} model={w.get('model', '?')} "
                     f"running={w.get('running', '?')} beat={w.get('beat_age_s')}s ago"
                     + _routing_line(w))
    for w in st.get("unreadable_workers", []):
        lines.append(f"  {w['name']:<24} unreadable heartbeat document, ignored: {w['why']}")
    lines.append(f"dead letters: {st['dead']['count']}")
    for d in st["dead"]["recent"]:
        lines.append(f"  {d['entry']} job={d.get('job_id', '?')} reason={d.get('reason', '?')}")
    return "\n".join(lines)


def _routing_line(w: dict) -> str:
    """Prefix hit rate and how prefix routing placed this worker's new jobs (issue 21)."""
    if w.get("routed_affinity") is None:  # it published no router status
        return ""
    rate = w.get("prefix_hit_rate")
    hit = f"{100 * rate:.0f}%" if isinstance(rate, (int, float)) else "-"
    return (f" prefix_hit={hit} routed affinity/load/fallback={w.get('routed_affinity', 0)}/"
            f"{w.get('routed_load', 0)}/{w.get('routed_fallback', 0)} "
            f"handed out/in={w.get('handed_off', 0)}/{w.get('handed_in', 0)}")


def letter(entry_id, fields: dict) -> dict:
    """A dead letter as its bytes came, decoded leniently: anyone may XADD one, in any bytes."""
    return {"entry": field_text(entry_id), **{field_text(k): field_text(v)
                                             for k, v in fields.items()}}
