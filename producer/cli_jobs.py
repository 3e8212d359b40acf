"""`genpool job show|stream|result|cancel ID` and `genpool dead list|retry|purge` (redis +
pydantic only). Every key comes from genpool.schemas.keys; retry re-enqueues through the submit script."""
from __future__ import annotations

import argparse
import json
import sys
import time

from genpool.schemas.config import HELP_FMT, add_connection_args, count, seconds
from genpool.schemas.keys import field_float, field_int
from genpool.schemas.tenants import DEFAULT_TENANT

from .cli import EXIT_FAILED, EXIT_NO_WORKERS, EXIT_TIMEOUT, follow, say_if_unserved


def register_job(sub) -> None:
    p = sub.add_parser("job", help="one job by id: show, stream, result, cancel",
                       description="Look at or act on one job by its id.", formatter_class=HELP_FMT)
    jsub = p.add_subparsers(dest="job_command", metavar="ACTION", required=True)
    show = jsub.add_parser("show", help="state, worker, attempts, timings, result or error",
                           formatter_class=HELP_FMT)
    stream = jsub.add_parser("stream", help="replay the job's tokens from the start, then follow",
                             formatter_class=HELP_FMT)
    result = jsub.add_parser("result", help="wait for the job and print its text (or error)",
                             formatter_class=HELP_FMT)
    cancel = jsub.add_parser("cancel", help="cancel the job (queued or running)",
                             formatter_class=HELP_FMT)
    for q, fn in ((show, cmd_show), (stream, cmd_stream), (result, cmd_result),
                  (cancel, cmd_cancel)):
        q.add_argument("id", help="job id")
        q.add_argument("--api-key", default=None, metavar="KEY",
                       help="act as this stored key's tenant: another tenant's job is not found "
                            "(default: none: every job, as whoever holds the Redis URL)")
        add_connection_args(q)
        q.set_defaults(func=fn)
    show.add_argument("--json", action="store_true", help="print JSON")
    for q in (stream, result):
        q.add_argument("--timeout", type=seconds, default=None,
                       help="seconds to wait at most (default: none: until the job ends)")
        q.add_argument("--json", action="store_true", help="print the final result as JSON")


def _client(a):
    from .client import Client

    return Client(a.redis, a.prefix)


def _view(a: argparse.Namespace, c) -> dict | None:
    """job_view, or None for a job the --api-key's tenant may not see (producer/job_access.py);
    a key that is not valid exits 2."""
    from .job_access import BadKey, key_tenant, visible

    try:
        return visible(job_view(c, a.id), key_tenant(c, a.api_key))
    except BadKey as e:
        print(f"genpool job: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def job_view(c, job_id: str) -> dict | None:
    """What `job show` prints: the job hash decoded, with timings and its stream's length."""
    keys = c.keys
    pipe = c.redis.pipeline(transaction=False)
    pipe.hgetall(keys.job(job_id))
    pipe.xlen(keys.events(job_id))
    pipe.ttl(keys.job(job_id))
    info, n_events, ttl = pipe.execute()
    if not info and not n_events:
        return None
    view: dict = {"id": job_id, "state": info.get("state", "unknown (no job hash)"),
                  "lane": info.get("lane"), "tenant": info.get("tenant", DEFAULT_TENANT),
                  "worker": info.get("worker"),
                  "attempts": field_int(info.get("attempts")) or 0, "events": n_events,
                  "expires_in_s": ttl if ttl and ttl > 0 else None,
                  "cancel_requested": info.get("cancel") == "1"}
    t = {k: x for k in ("submitted_at", "started_at", "finished_at")
         if (x := field_float(info.get(k))) is not None}  # junk, NaN, inf: not shown
    if "submitted_at" in t:
        view["submitted"] = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t["submitted_at"]))
        end = t.get("finished_at", time.time())
        view["queued_s"] = round(t.get("started_at", end) - t["submitted_at"], 3)
        view["age_s" if "finished_at" not in t else "total_s"] = round(end - t["submitted_at"], 3)
    for field in ("result", "error"):
        if info.get(field):
            try:
                view[field] = json.loads(info[field])
            except (ValueError, RecursionError):  # someone else's write
                view[field] = {"unreadable": info[field][:200]}
    return view


def end_summary(job, res) -> str:
    """How a followed job ended, for its last line. A cancel carries no usage or timings (the
    wire's cancel is a bare error event), so a cancelled job's come from what Redis recorded:
    the tokens streamed, its first token event's entry time and the hash's timestamps."""
    if res.finish_reason != "cancelled":
        t = res.timings
        ttft = "ttft unknown" if t.ttft_s is None else f"ttft {t.ttft_s:.3f} s"
        return (f"{res.finish_reason}; {res.usage.prompt_tokens} prompt + "
                f"{res.usage.completion_tokens} completion tokens; {ttft}, total {t.total_s:.3f} s")
    c, n = job.client, len(res.token_ids)
    submitted, finished = c.redis.hmget(c.keys.job(job.id), "submitted_at", "finished_at")
    total = (f"total {float(finished) - float(submitted):.3f} s" if submitted and finished
             else "total unknown")
    if not n:
        return f"cancelled before its first token; {total}"
    first = _first_token_at(c, job.id)
    ttft = (f"ttft {first - float(submitted):.3f} s" if first and submitted else "ttft unknown")
    return (f"cancelled; prompt tokens unknown, {n} completion tokens before the cancel; "
            f"{ttft}, {total}")


def _first_token_at(c, job_id: str, look: int = 64) -> float | None:
    """Unix time of the job's first token event (its entry id's milliseconds), if among the
    stream's first `look` entries (a token is the first event but after a rerun's restart)."""
    for entry_id, fields in c.redis.xrange(c.keys.events(job_id), count=look):
        try:
            kind = json.loads(fields.get("event") or "{}").get("type")
        except (ValueError, AttributeError):
            continue
        if kind == "token":
            return int(entry_id.split("-", 1)[0]) / 1000.0
    return None


def cmd_show(a: argparse.Namespace) -> int:
    c = _client(a)
    view = _view(a, c)
    if view is None:
        print(f"genpool job: no job {a.id!r} on prefix {c.keys.prefix!r} (unknown, or its result "
              f"expired)", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(view, indent=2, ensure_ascii=False))
        return 0
    res, err = view.pop("result", None), view.pop("error", None)
    for k, v in view.items():
        if v is not None:
            print(f"{k:<17} {v}")
    if res is not None:
        print(f"{'finish_reason':<17} {res.get('finish_reason')}")
        print(f"{'usage':<17} {res.get('usage')}")
        print(f"{'timings':<17} {res.get('timings')}")
        print(f"{'text':<17} {res.get('text', '')!r}")
    if err is not None:
        print(f"{'error':<17} ({err.get('code')}) {err.get('message')}")
    if view["state"] == "queued":
        say_if_unserved(c.job(a.id), waiting=False)
    return 0


def cmd_stream(a: argparse.Namespace) -> int:
    c = _client(a)
    if _view(a, c) is None:
        print(f"genpool job: no job {a.id!r} on prefix {c.keys.prefix!r}", file=sys.stderr)
        return 2
    return follow(c.job(a.id), a.timeout, a.json, "job stream")


def cmd_result(a: argparse.Namespace) -> int:
    from .errors import NoWorkers

    c = _client(a)
    if _view(a, c) is None:
        print(f"genpool job: no job {a.id!r} on prefix {c.keys.prefix!r}", file=sys.stderr)
        return 2
    try:
        res = c.job(a.id).result(timeout=a.timeout, raise_on_error=False)
    except NoWorkers as e:
        print(f"genpool job result: {e}", file=sys.stderr)
        return EXIT_NO_WORKERS
    except TimeoutError as e:
        print(f"genpool job result: {e}", file=sys.stderr)
        return EXIT_TIMEOUT
    if a.json:
        print(res.model_dump_json(indent=2))
    elif res.finish_reason is not None:
        print(res.text)
    if res.error is not None and res.finish_reason != "cancelled":
        print(f"error ({res.error.code}): {res.error.message}", file=sys.stderr)
        return EXIT_FAILED
    return 0


def cmd_cancel(a: argparse.Namespace) -> int:
    c = _client(a)
    view = _view(a, c)
    if view is None:
        print(f"genpool job: no job {a.id!r} on prefix {c.keys.prefix!r}", file=sys.stderr)
        return 2
    if view.get("result") or view.get("error"):
        print(f"job {a.id} already ended ({view['state']}); nothing to cancel", file=sys.stderr)
        return 0
    c.cancel(a.id)
    print(f"cancel sent for job {a.id} (was {view['state']})", file=sys.stderr)
    return 0


# -- dead letters -------------------------------------------------------------------------------
def register_dead(sub) -> None:
    p = sub.add_parser("dead", help="the dead-letter stream: list, retry, purge",
                       description="Entries no worker could run (junk, or delivered too often), "
                       "with the reason.", formatter_class=HELP_FMT)
    dsub = p.add_subparsers(dest="dead_command", metavar="ACTION", required=True)
    ls = dsub.add_parser("list", help="the newest dead letters", formatter_class=HELP_FMT)
    ls.add_argument("--count", type=count, default=20, help="how many, newest first")
    ls.add_argument("--json", action="store_true", help="print JSON lines")
    retry = dsub.add_parser("retry", help="re-enqueue dead-lettered jobs as new attempts",
                            formatter_class=HELP_FMT)
    purge = dsub.add_parser("purge", help="delete dead letters", formatter_class=HELP_FMT)
    for q in (retry, purge):
        q.add_argument("entries", nargs="*", help="dead-letter entry ids (from `dead list`)")
        q.add_argument("--all", action="store_true", help="every entry in the dead-letter stream")
    for q, fn in ((ls, cmd_dead_list), (retry, cmd_dead_retry), (purge, cmd_dead_purge)):
        add_connection_args(q)
        q.set_defaults(func=fn)


def cmd_dead_list(a: argparse.Namespace) -> int:
    from .dead import dead_entries

    c = _client(a)
    entries = dead_entries(c, a.count)
    total = c.redis.xlen(c.keys.dead)
    for d in entries:
        if a.json:
            print(json.dumps(d, ensure_ascii=False))
        else:
            print(f"{d['entry']}  job={d.get('job_id', '-')}  deliveries={d.get('deliveries')}  "
                  f"reason={d.get('reason')}")
    print(f"{len(entries)} shown of {total} dead letters on prefix {c.keys.prefix!r}",
          file=sys.stderr)
    return 0


def _chosen(a) -> list[str] | None:
    if not a.all and not a.entries:
        print(f"genpool dead {a.dead_command}: name entry ids or pass --all", file=sys.stderr)
        return None
    return None if a.all else a.entries


def cmd_dead_retry(a: argparse.Namespace) -> int:
    from .dead import retry_dead

    ids = _chosen(a)
    if ids is None and not a.all:
        return 2
    done, refused = retry_dead(_client(a), ids)
    for entry, job_id in done:
        print(f"{entry}: job {job_id} queued again")
    for entry, why in refused:
        print(f"{entry}: not retried ({why})", file=sys.stderr)
    return 1 if refused else 0


def cmd_dead_purge(a: argparse.Namespace) -> int:
    from .dead import purge_dead

    ids = _chosen(a)
    if ids is None and not a.all:
        return 2
    n = purge_dead(_client(a), ids)
    print(f"deleted {n} dead letters", file=sys.stderr)
    return 0
