"""`genpool usage [--tenant T] [--since 24h] [--json]`: tokens per tenant (issue 31).

Workers count each result's prompt and completion tokens into hourly hashes
(schemas/tenants.py `usage`, workers/usage.py), kept USAGE_TTL_S; this reads the hours asked for
(one HGETALL each, pipelined) and sums them per tenant.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict
from datetime import datetime, timezone

from genpool.schemas.config import HELP_FMT, add_connection_args
from genpool.schemas.tenants import USAGE_BUCKET_S, USAGE_TTL_S, TenantKeys, tenant_arg

_SPAN = re.compile(r"^(\d+(?:\.\d+)?)([hd])$")
FIELDS = ("prompt", "completion", "jobs")


def parse_since(text: str, now: float) -> float:
    """'24h' / '7d' (ago), an ISO date or time (UTC unless it says), or unix seconds."""
    m = _SPAN.match(text.strip())
    if m:
        return now - float(m.group(1)) * (3600 if m.group(2) == "h" else 86400)
    try:
        return float(text)
    except ValueError:
        pass
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"--since {text!r}: use 24h, 7d, an ISO date (2026-12-01) or unix "
                         f"seconds") from None
    return (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).timestamp()


def read_usage(r, keys, since: float, now: float) -> dict[str, dict[str, int]]:
    """{tenant: {prompt, completion, jobs, total}} over the hours from `since` to `now`."""
    first = int(max(since, now - USAGE_TTL_S)) // USAGE_BUCKET_S
    hours = range(first, int(now) // USAGE_BUCKET_S + 1)
    pipe = r.pipeline(transaction=False)
    t = TenantKeys(keys)
    for h in hours:
        pipe.hgetall(t.usage(h))
    out: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(FIELDS, 0))
    for bucket in pipe.execute():
        for name, value in bucket.items():
            tenant, _, what = name.rpartition(":")
            if what in FIELDS and tenant:
                out[tenant][what] += int(value)
    for row in out.values():
        row["total"] = row["prompt"] + row["completion"]
    return dict(out)


def register_usage(sub) -> None:
    p = sub.add_parser("usage", help="prompt and completion tokens per tenant",
                       formatter_class=HELP_FMT,
                       description="Tokens per tenant, counted once with each job's result, "
                       f"in hourly buckets kept {USAGE_TTL_S // 86400} days.")
    p.add_argument("--tenant", type=tenant_arg, default=None, help="only this tenant (default: none: every tenant)")
    p.add_argument("--since", default="24h",
                   help="from when: 24h, 7d, an ISO date or time (UTC), or unix seconds; whole "
                        "hours are counted")
    p.add_argument("--json", action="store_true", help="print JSON")
    add_connection_args(p)
    p.set_defaults(func=cmd_usage)


def cmd_usage(a: argparse.Namespace) -> int:
    from genpool.schemas import Keys
    from genpool.schemas.config import key_prefix, redis_url
    from genpool.schemas.connection import connect

    now = time.time()
    try:
        since = parse_since(a.since, now)
    except ValueError as e:
        print(f"genpool usage: {e}", file=sys.stderr)
        return 2
    r = connect(redis_url(a.redis), decode_responses=True)
    rows = read_usage(r, Keys(key_prefix(a.prefix)), since, now)
    if a.tenant is not None:
        rows = {a.tenant: rows.get(a.tenant, {**dict.fromkeys(FIELDS, 0), "total": 0})}
    if a.json:
        print(json.dumps({"since": since, "until": now, "tenants": rows}, sort_keys=True))
        return 0
    print(f"{'tenant':<24} {'jobs':>8} {'prompt':>12} {'completion':>12} {'total':>12}")
    for tenant, row in sorted(rows.items(), key=lambda kv: -kv[1]["total"]):
        print(f"{tenant:<24} {row['jobs']:>8} {row['prompt']:>12} {row['completion']:>12} "
              f"{row['total']:>12}")
    return 0
