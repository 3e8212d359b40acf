"""`genpool jobs list`: the job ids in the lanes, or finished ones, by lane and state (redis +
pydantic only; what is read, and what it costs, is in producer/listing.py)."""
from __future__ import annotations

import argparse
import json
import sys

from genpool.schemas.config import HELP_FMT, add_connection_args, count
from genpool.schemas.keys import JOB_STATES, LANES

from .listing import SCAN_MAX


def register_jobs(sub) -> None:
    p = sub.add_parser("jobs", help="job ids by lane and state: queued, running, cancelled, "
                                    "finished", formatter_class=HELP_FMT,
                       description="List jobs by id. Without --state: every job in the lanes "
                       "(queued, running, and cancelled while queued: those never run), lane by "
                       "lane, oldest first. A finished --state (done, error, cancelled, expired, "
                       "dead) also SCANs the job hashes (a pass over the database's keys), "
                       "newest first.")
    jsub = p.add_subparsers(dest="jobs_command", metavar="ACTION", required=True)
    ls = jsub.add_parser("list", help="job ids with lane, state, age, worker, attempts",
                         formatter_class=HELP_FMT)
    ls.add_argument("--lane", choices=LANES, default=None,
                    help="only this lane (default: none: every lane)")
    ls.add_argument("--state", choices=JOB_STATES, default=None,
                    help="only jobs in this state (default: none: every job in the lanes)")
    ls.add_argument("--limit", type=count, default=50, help="show at most this many")
    ls.add_argument("--json", action="store_true", help="print JSON lines")
    add_connection_args(ls)
    ls.set_defaults(func=cmd_jobs_list)


def cmd_jobs_list(a: argparse.Namespace) -> int:
    from genpool.schemas.connection import connect

    from .client import Client
    from .listing import list_jobs

    if a.limit < 1:
        print("genpool jobs list: --limit must be >= 1", file=sys.stderr)
        return 2
    c = Client(a.redis, a.prefix)
    raw = connect(c.url, decode_responses=False)  # bytes in: a junk lane entry must not choke it
    rows = list_jobs(raw, c.lane_keys(), a.lane, a.state)
    shown = rows[:a.limit]
    if a.json:
        for row in shown:
            print(json.dumps(row, ensure_ascii=False))
    else:
        print(f"{'id':<34} {'lane':<6} {'state':<9} {'age_s':>9}  {'attempts':>8}  worker")
        for row in shown:
            age = "-" if row["age_s"] is None else f"{row['age_s']:.1f}"
            print(f"{row['id']:<34} {row['lane'] or '-':<6} {row['state']:<9} {age:>9}  "
                  f"{row['attempts']:>8}  {row['worker'] or '-'}")
    which = ", ".join(f"{k} {v}" for k, v in (("lane", a.lane), ("state", a.state)) if v)
    more = (f"; {len(rows) - len(shown)} more (raise --limit)" if len(rows) > len(shown) else "")
    capped = f" (each lane read up to {SCAN_MAX} entries)" if len(rows) >= SCAN_MAX else ""
    print(f"{len(shown)} jobs shown{' (' + which + ')' if which else ''} on prefix "
          f"{c.keys.prefix!r}{more}{capped}", file=sys.stderr)
    return 0
