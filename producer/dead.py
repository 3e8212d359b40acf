"""The dead-letter stream for operators: read it, retry its jobs, purge it (redis + pydantic)."""
from __future__ import annotations

from typing import Optional

from pydantic import ValidationError

from genpool.schemas import JobRequest, describe_validation_error
from genpool.schemas.scripts import RETRY_RESET_LUA

from .client import _retrying
from .protocol import submit_args


def dead_entries(c, count: int = 20, ids: Optional[list[str]] = None) -> list[dict]:
    """Newest first (or exactly `ids`), each {"entry": id, **fields}."""
    r, key = c.redis, c.keys.dead
    if ids is None:
        rows = r.xrevrange(key, count=count)
    else:
        rows = [row for i in ids for row in r.xrange(key, i, i)]
    return [{"entry": i, **f} for i, f in rows]


def retry_dead(c, ids: Optional[list[str]]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Re-enqueue each chosen entry's job under its own id: its old job hash and event stream are
    dropped first (their terminal dead_lettered event would end any new reader at once), then
    the job is submitted as a fresh one (its hash says `retry_of` = the dead-letter entry id);
    the dead letter is deleted. Entries whose payload is not a valid job (junk, truncated) are
    refused and kept.

    One server: all of it in one MULTI. A cluster: one-slot steps, so each is atomic on its own
    and a retry cut off anywhere can be run again without enqueueing the job twice (see
    `_retry_cluster`)."""
    entries = dead_entries(c, count=c.redis.xlen(c.keys.dead) or 1, ids=ids)
    c.lane_keys()  # the lane shards workers read: a retried job is spread like a fresh submit
    done, refused = [], []
    for d in entries:
        try:
            req = JobRequest.model_validate_json(d.get("payload", ""))
        except ValidationError as e:
            why = describe_validation_error(e) if e.title == "JobRequest" else str(e)
            if any(err["type"] == "json_invalid" for err in e.errors()):
                why = "it holds no job JSON (a junk entry); purge it"
            refused.append((d["entry"], f"its payload is not a valid job: {why}"))
            continue
        (_retry_cluster if c.cluster else _retry_single)(c, d["entry"], req)
        done.append((d["entry"], req.id))
    if ids is not None:
        found = {d["entry"] for d in entries}
        refused += [(i, "no such dead-letter entry") for i in ids if i not in found]
    return done, refused


def _retry_single(c, entry: str, req: JobRequest) -> None:
    """Drop, submit, XDEL in one MULTI: it happens entirely or not at all."""
    k = c.keys
    pipe = c.redis.pipeline(transaction=True)
    pipe.delete(k.job(req.id), k.events(req.id))
    c._submit(keys=[k.job(req.id), k.submit_stream(req.id, req.lane)],
              args=submit_args(req, c.job_ttl_s), client=pipe)
    pipe.hset(k.job(req.id), "retry_of", entry)
    pipe.xdel(k.dead, entry)
    pipe.execute()


def _retry_cluster(c, entry: str, req: JobRequest) -> None:
    """Three one-slot steps, the dead letter last, so an interrupted retry leaves it to run again:
    1. RETRY_RESET_LUA in the job's `{id}` slot drops its hash and events and marks the fresh
       hash `retry_of` = entry; it answers 0 when that mark and an `entry` are already there (an
       earlier run of this retry enqueued it), and then nothing is enqueued again;
    2. the client's cluster submit (SUBMIT_JOB_LUA, XADD on the job's lane shard, HSETNX entry),
       which completes a submit cut off half-way;
    3. XDEL of the dead letter in the `{prefix}` slot."""
    k = c.keys
    reset = c.redis.register_script(RETRY_RESET_LUA)
    if _retrying(lambda: reset(keys=[k.job(req.id), k.events(req.id)],
                               args=[entry, c.job_ttl_s])):
        _retrying(lambda: c._enqueue_cluster([req]))
    _retrying(lambda: c.redis.xdel(k.dead, entry))


def purge_dead(c, ids: Optional[list[str]]) -> int:
    if ids is None:
        n = c.redis.xlen(c.keys.dead)
        c.redis.delete(c.keys.dead)
        return n
    return c.redis.xdel(c.keys.dead, *ids) if ids else 0
