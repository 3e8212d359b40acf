"""The dead-letter stream for operators: read it, retry its jobs, purge it (redis + pydantic)."""
from __future__ import annotations

import re
from typing import Optional

import redis
from pydantic import ValidationError

from genpool.schemas import JobRequest, describe_validation_error
from genpool.schemas.keys import field_text
from genpool.schemas.scripting import Script
from genpool.schemas.scripts import RETRY_RESET_LUA

from .client import SUBMIT
from .fair_submit import submit_keys
from .protocol import submit_args
from .retry import retrying
from .status import letter

RETRY_RESET = Script(RETRY_RESET_LUA)


ENTRY_ID_RE = re.compile(r"^\d+-\d+$")  # a whole id: "ms" alone would be every entry of that ms


def dead_entries(c, count: int = 20, ids: Optional[list[str]] = None) -> list[dict]:
    """Newest first (or exactly `ids`: whole entry ids only), each {"entry": id, **fields}."""
    r, key = c.raw, c.keys.dead
    if ids is None:
        rows = r.xrevrange(key, count=count)
    else:
        rows = [row for i in ids if ENTRY_ID_RE.match(i) for row in r.xrange(key, i, i)]
    return [letter(i, f) for i, f in rows]


def _every_dead(c, page: int = 500):
    """Every dead letter there is now, oldest first, a page at a time (the stream may hold
    100,000 entries of up to 64 KiB: one XRANGE of all of them is gigabytes in one reply). Up to
    the newest id at the start: a job retried here that dies again is not retried twice."""
    newest = c.raw.xrevrange(c.keys.dead, count=1)
    if not newest:
        return
    start, end = "-", field_text(newest[0][0])
    while rows := c.raw.xrange(c.keys.dead, start, end, count=page):
        for i, f in rows:
            yield letter(i, f)
        start = "(" + field_text(rows[-1][0])


def retry_dead(c, ids: Optional[list[str]]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Re-enqueue each chosen entry's job under its own id: its old job hash and event stream are
    dropped first (their terminal dead_lettered event would end any new reader at once), then
    the job is submitted as a fresh one (its hash says `retry_of` = the dead-letter entry id);
    the dead letter is deleted. Refused and kept: entries whose payload is not a valid job
    (junk, truncated), entries naming a job that is not dead (anyone can XADD a dead letter: a
    retry never replaces a queued, running or finished job), and entries whose lane refuses
    the submit. Each retry is three one-slot steps (see `_retry`), on one server as on a
    Cluster, so a retry cut off anywhere can be run again without enqueueing the job twice."""
    entries = _every_dead(c) if ids is None else dead_entries(c, ids=ids)  # lazily: no list
    c.lane_keys()  # the lane shards workers read: a retried job is spread like a fresh submit
    done, refused = [], []
    for d in entries:
        req, why = _job_of(d)
        why = why or _retry(c, d["entry"], req)
        if why:
            refused.append((d["entry"], why))
        else:
            done.append((d["entry"], req.id))
    if ids is not None:
        found = {d["entry"] for d in entries}
        refused += [(i, "no such dead-letter entry") for i in ids if i not in found]
    return done, refused


def _job_of(d: dict) -> tuple[Optional[JobRequest], str]:
    try:
        return JobRequest.model_validate_json(d.get("payload", "")), ""
    except ValidationError as e:
        why = describe_validation_error(e) if e.title == "JobRequest" else str(e)
        if any(err["type"] == "json_invalid" for err in e.errors()):
            why = "it holds no job JSON (a junk entry); purge it"
        return None, f"its payload is not a valid job: {why}"


def _retry(c, entry: str, req: JobRequest) -> str:
    """Three one-slot steps, the dead letter last, so an interrupted retry leaves it to run
    again; returns why it was refused ("" when the job is queued again):
    1. RETRY_RESET_LUA in the job's `{id}` slot: refuses a job that is not dead, else drops its
       hash and events and marks the fresh hash `retry_of` = entry; it answers 0 when that mark
       and an `entry` are already there (an earlier run of this retry enqueued it);
    2. the submit (SUBMIT_LUA; on a Cluster SUBMIT_JOB_LUA, XADD on the job's lane shard,
       HSETNX entry, which completes a submit cut off half-way): a lane that refuses it stores
       nothing, and the dead letter stays;
    3. XDEL of the dead letter in the `{prefix}` slot."""
    k = c.keys
    go = retrying(lambda: RETRY_RESET(c.redis, [k.job(req.id), k.events(req.id)],
                                      [entry, c.job_ttl_s]))
    if isinstance(go, (str, bytes)):
        state = go.decode() if isinstance(go, bytes) else go
        return f"job {req.id} is {state}: a retry never replaces a job that is not dead"
    if go:
        try:
            queued = retrying(lambda: _submit(c, req))
        except redis.ResponseError as e:
            return f"not queued: {e}"
        # None: the id existed; it is this retry's own (a reply lost, the submit retried)
        # when it carries this letter's mark, else another submit took the id meanwhile
        mark = c.redis.hget(k.job(req.id), "retry_of") if queued is None else entry
        if mark not in (entry, entry.encode()):
            return f"job {req.id} was submitted again meanwhile, not by this retry"
    retrying(lambda: c.redis.xdel(k.dead, entry))
    return ""


def _submit(c, req: JobRequest):
    """The client's own submit of one request: its entry id, or None when the id exists."""
    if c.cluster:
        return c._enqueue_cluster([req])[0]
    k = c.keys
    return SUBMIT(c.redis, submit_keys(k, req), submit_args(req, c.job_ttl_s))


def purge_dead(c, ids: Optional[list[str]]) -> int:
    if ids is None:
        n = c.redis.xlen(c.keys.dead)
        c.redis.delete(c.keys.dead)
        return n
    return c.redis.xdel(c.keys.dead, *ids) if ids else 0
