"""`genpool lanes check|repair`: find lane streams that can no longer take entries, and mend them
(redis + pydantic only).

A lane breaks when something XADDs to it with an explicit id from the future: every later id
must follow it, and after the last possible id (18446744073709551615-18446744073709551615) no
XADD succeeds at all, so every submit to that lane fails. The repair (schemas/repair.py,
LANE_REPAIR_LUA) is in place and atomic per lane; docs/operations.md tells the operator's side.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field

import redis

from genpool.schemas.config import HELP_FMT, add_connection_args, seconds
from genpool.schemas.keys import JOB_ID_RE
from genpool.schemas.repair import ENTRY_UNBIND_LUA, LANE_REPAIR_LUA
from genpool.schemas.scripting import Script
from genpool.schemas.tenants import known_sub_streams, queue_known

AHEAD_S = 60.0  # ids further ahead of the Redis clock than this are poison (a clock step is not)
LANE_REPAIR, ENTRY_UNBIND = Script(LANE_REPAIR_LUA), Script(ENTRY_UNBIND_LUA)


@dataclass
class LaneState:
    stream: str
    last_id: str  # "" when the stream does not exist yet
    repaired_to: str = ""  # = last_id: healthy; "": poisoned; else: repaired, the new last id
    moved: list[tuple[str, str, str]] = field(default_factory=list)  # (old id, new id, job id)
    groups: list[tuple[str, str, str]] = field(default_factory=list)  # (name, was, set to)

    @property
    def poisoned(self) -> bool:
        return self.repaired_to != self.last_id


def register_lanes(sub) -> None:
    p = sub.add_parser("lanes", help="lane streams: check them, repair one that refuses entries",
                       description="Lane streams whose entry ids ran ahead of the clock (a raw "
                       "XADD with an explicit id) refuse new jobs; repair mends them in place, "
                       "keeping every queued and running job.", formatter_class=HELP_FMT)
    lsub = p.add_subparsers(dest="lanes_command", metavar="ACTION", required=True)
    check = lsub.add_parser("check", help="say which lanes are poisoned (exit 1 if any)",
                            formatter_class=HELP_FMT)
    repair = lsub.add_parser("repair", help="mend every poisoned lane in place",
                             formatter_class=HELP_FMT)
    for q, fn in ((check, cmd_check), (repair, cmd_repair)):
        q.add_argument("--ahead-s", type=seconds, default=AHEAD_S,
                       help="entry ids more than this many seconds ahead of the Redis server's "
                            "clock count as poison")
        q.add_argument("--json", action="store_true", help="print one JSON object per lane")
        add_connection_args(q)
        q.set_defaults(func=fn)


def lane_states(c, ahead_s: float) -> list[LaneState]:
    """Every lane stream of every shard, and every tenant's sub-stream of one (fair pull), as
    LANE_REPAIR_LUA finds it (changing nothing)."""
    keys = c.lane_keys()
    pipe = c.redis.pipeline(transaction=False)
    queue_known(pipe, keys)
    subs = known_sub_streams(keys, pipe.execute(raise_on_error=False))
    return [_run(c, stream, ahead_s, "check") for stream in [*keys.all_jobs(), *subs]]


def _run(c, stream: str, ahead_s: float, mode: str) -> LaneState:
    last, after, moved, groups = LANE_REPAIR(c.redis, [stream], [int(ahead_s * 1000), mode])
    return LaneState(stream, last, after,
                     [(old, new, jid if JOB_ID_RE.match(jid) else "")
                      for old, new, jid in _triples(moved)], _triples(groups))


def _triples(flat: list) -> list[tuple]:
    return [tuple(flat[i:i + 3]) for i in range(0, len(flat), 3)]


def repair_lanes(c, ahead_s: float) -> list[LaneState]:
    """Mend every poisoned lane. The job hash of each entry about to get a new id stops naming
    the old one (ENTRY_UNBIND_LUA) before the repair and again after it: the copy then owns the
    job unless a worker claims the old entry in between (and that worker runs it then)."""
    out = []
    for st in lane_states(c, ahead_s):
        if not st.poisoned:
            out.append(st)
            continue
        _unbind(c, st.moved)
        fixed = _run(c, st.stream, ahead_s, "repair")
        _unbind(c, fixed.moved)
        out.append(fixed)
    return out


def _unbind(c, moved) -> None:
    for old, _, job_id in moved:
        if job_id:
            try:
                ENTRY_UNBIND(c.redis, [c.keys.job(job_id)], [old])
            except redis.ResponseError as e:  # not a hash (clobbered): nothing names the entry
                print(f"job {job_id}: its job hash is unreadable ({e})", file=sys.stderr)


def _show(st: LaneState, as_json: bool) -> None:
    if as_json:
        print(json.dumps({**st.__dict__, "poisoned": st.poisoned}))
        return
    if not st.poisoned:
        print(f"{st.stream}: ok (last id {st.last_id or '-'})")
        return
    done = st.repaired_to != ""
    print(f"{st.stream}: poisoned: last id {st.last_id} is ahead of the clock"
          + (f"; repaired: last id now {st.repaired_to}" if done else ""))
    for old, new, job_id in st.moved:
        print(f"  entry {old} (job {job_id or '-'})" + (f" queued again as {new}" if new else
                                                         " will be queued again"))
    for name, was, to in st.groups:
        print(f"  group {name}: last delivered {was}" + (f" set back to {to}" if to else
                                                         " will be set back"))


def _client(a):
    from .client import Client

    return Client(a.redis, a.prefix)


def cmd_check(a: argparse.Namespace) -> int:
    states = lane_states(_client(a), a.ahead_s)
    for st in states:
        _show(st, a.json)
    bad = [st for st in states if st.poisoned]
    if bad and not a.json:
        print(f"{len(bad)} poisoned lane stream(s): `genpool lanes repair` mends them",
              file=sys.stderr)
    return 1 if bad else 0


def cmd_repair(a: argparse.Namespace) -> int:
    states = repair_lanes(_client(a), a.ahead_s)
    fixed = [st for st in states if st.poisoned]
    for st in fixed:
        _show(st, a.json)
    if not fixed and not a.json:
        print("every lane takes entries: nothing to repair")
    return 0
