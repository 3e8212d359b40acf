"""`genpool keys create|list|revoke|limits`: API keys and tenants' limits as data (issue 31).

The secret is printed once, by `create`, on stdout alone (so `KEY=$(genpool keys create ...)`
works); every other line goes to stderr, and no other command ever shows a secret.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from genpool.schemas.config import HELP_FMT, add_connection_args, positive
from genpool.schemas.request import CALLER_PRIORITY_CEILING
from genpool.schemas.tenants import API_KEY_TTL_S, tenant_arg


def register_keys(sub) -> None:
    p = sub.add_parser("keys", help="API keys of the gateway: create, list, revoke; tenants' "
                                    "limits", formatter_class=HELP_FMT,
                       description="API keys stored hashed in Redis: each names a tenant, the "
                       "models it may use and a priority ceiling. Every gateway on the prefix "
                       "accepts them (and refuses a revoked one within seconds); `genpool "
                       "gateway --api-key` keys still work beside them.")
    ks = p.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    c = ks.add_parser("create", help="create a key; prints the secret once",
                      formatter_class=HELP_FMT)
    c.add_argument("--tenant", type=tenant_arg, required=True, help="whose jobs it submits")
    c.add_argument("--model", action="append", default=None, metavar="NAME",
                   help="a model it may use (repeat; default: none: any model)")
    c.add_argument("--priority-ceiling", type=int, default=CALLER_PRIORITY_CEILING,
                   help="the most urgent priority its requests may ask for (lower runs sooner)")
    c.add_argument("--name", default="", help="a note: who holds it")
    c.add_argument("--days", type=positive, default=API_KEY_TTL_S / 86400,
                   help="how long it is valid")
    c.set_defaults(func=cmd_create)
    ls = ks.add_parser("list", help="keys (never their secrets)", formatter_class=HELP_FMT)
    ls.add_argument("--json", action="store_true", help="print JSON lines")
    ls.set_defaults(func=cmd_list)
    rv = ks.add_parser("revoke", help="revoke a key by its id (key_...)", formatter_class=HELP_FMT)
    rv.add_argument("key_id", help="the key's id, as `genpool keys list` shows it")
    rv.set_defaults(func=cmd_revoke)
    lim = ks.add_parser("limits", help="show or set a tenant's limits (shared by its keys)",
                        formatter_class=HELP_FMT)
    lim.add_argument("tenant", type=tenant_arg, help="the tenant whose limits to show or set")
    for flag, what in (("--rpm", "requests per minute"), ("--tpm", "tokens per minute"),
                       ("--max-concurrent", "jobs running at once, pool-wide (taken at "
                                            "claim time)"),
                       ("--max-queued", "jobs waiting at once (checked at submit)")):
        lim.add_argument(flag, type=int, default=None,
                         help=f"{what}; 0 removes the limit (default: none: unchanged)")
    lim.add_argument("--weight", type=int, default=None,
                     help="its share in fair pull (default: none: unchanged)")
    lim.set_defaults(func=cmd_limits)
    for q in (c, ls, rv, lim):
        add_connection_args(q)


def _store(a: argparse.Namespace):
    from genpool.schemas import Keys
    from genpool.schemas.config import key_prefix, redis_url
    from genpool.schemas.connection import connect

    from .keys_store import KeyStore

    return KeyStore(connect(redis_url(a.redis), decode_responses=True), Keys(key_prefix(a.prefix)))


def cmd_create(a: argparse.Namespace) -> int:
    try:
        secret, key = _store(a).create(a.tenant, a.model or [], a.priority_ceiling, a.name,
                                       a.days)
    except ValueError as e:  # pydantic's ValidationError is one: the priority ceiling's range
        print(f"genpool keys create: {e}", file=sys.stderr)
        return 2
    print(secret)
    print(f"created {key.id} for tenant {key.tenant!r}; the secret above is shown only now",
          file=sys.stderr)
    return 0


def cmd_list(a: argparse.Namespace) -> int:
    keys = _store(a).list()
    if a.json:
        for k in keys:
            print(k.model_dump_json())
        return 0
    print(f"{'id':<17} {'tenant':<20} {'ceiling':>7}  {'expires':<10} {'models':<24} name")
    for k in keys:
        day = time.strftime("%Y-%m-%d", time.gmtime(k.expires))
        print(f"{k.id:<17} {k.tenant:<20} {k.priority_ceiling:>7}  {day:<10} "
              f"{','.join(k.models) or '(any)':<24} {k.name}")
    return 0


def cmd_revoke(a: argparse.Namespace) -> int:
    if not _store(a).revoke(a.key_id):
        print(f"genpool keys revoke: no key {a.key_id!r}", file=sys.stderr)
        return 1
    print(f"revoked {a.key_id}; gateways refuse it within seconds", file=sys.stderr)
    return 0


def cmd_limits(a: argparse.Namespace) -> int:
    store = _store(a)
    limits = store.limits(a.tenant)
    given = {f: getattr(a, f) for f in ("rpm", "tpm", "max_concurrent", "max_queued", "weight")
             if getattr(a, f) is not None}
    if any(v < 0 for v in given.values()):
        print("genpool keys limits: limits must be >= 0", file=sys.stderr)
        return 2
    if given:
        merged = {**limits.model_dump(), **{f: (v or None) for f, v in given.items()}}
        merged["weight"] = merged["weight"] or 1
        try:
            limits = type(limits).model_validate(merged)
        except ValueError as e:
            print(f"genpool keys limits: {e}", file=sys.stderr)
            return 2
        store.set_limits(a.tenant, limits)
    print(json.dumps({"tenant": a.tenant, **limits.model_dump()}))
    return 0
