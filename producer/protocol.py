"""Producer-side protocol pieces shared by the sync and async clients (no I/O here)."""
from __future__ import annotations

import time
from typing import Any, Iterator, Optional, Union

from pydantic import ValidationError

from schemas import LANES, ChatMessage, ErrorEvent, JobRequest, ResultEvent, describe_validation_error
from schemas import parse_event as _parse_event

JOB_TTL_S = 7 * 86400  # a queued job's hash lives this long; workers shorten it once done
CONTROL_MAXLEN = 10_000
READ_BLOCK_MS = 5_000
READ_COUNT = 1_000


def queue_lane_depths(pipe, keys) -> None:
    """Queue, on a sync or asyncio pipeline, what lane_depths() reads: XLEN and the group's
    XPENDING summary of every lane."""
    for lane in LANES:
        pipe.xlen(keys.jobs(lane))
        pipe.xpending(keys.jobs(lane), keys.group)


def lane_depths(replies: list) -> dict[str, tuple[int, int]]:
    """{lane: (queued, pending)} from queue_lane_depths()' replies (executed with
    raise_on_error=False: a lane or group not created yet counts as empty). Workers delete the
    entries they ack (docs/protocol.md), so a stream holds exactly its queued (never delivered)
    entries plus the pending ones."""
    out = {}
    for i, lane in enumerate(LANES):
        length, summary = replies[2 * i], replies[2 * i + 1]
        pending = int(summary["pending"]) if isinstance(summary, dict) else 0
        length = length if isinstance(length, int) else 0
        out[lane] = (max(0, length - pending), pending)
    return out


# Atomic "create unless it exists" + enqueue. One script call is one round trip and cannot leave a
# job hash without its stream entry (which a two-step HSETNX-then-XADD could after a crash).
# KEYS[1] job hash, KEYS[2] lane stream; ARGV: job JSON, lane, submit time, TTL seconds.
# Returns the stream entry id, or false when the job id already exists (it runs only once).
SUBMIT_LUA = """
if redis.call('HSETNX', KEYS[1], 'state', 'queued') == 0 then
  return false
end
local entry = redis.call('XADD', KEYS[2], '*', 'job', ARGV[1])
redis.call('HSET', KEYS[1], 'entry', entry, 'lane', ARGV[2], 'submitted_at', ARGV[3],
           'attempts', 0)
redis.call('EXPIRE', KEYS[1], ARGV[4])
return entry
"""

# Set the cancel flag (keeping the hash's TTL if it has one; EXPIRE NX needs Redis 7) and broadcast
# the cancel on the control stream. KEYS[1] job hash, KEYS[2] control stream;
# ARGV: job id, time, TTL seconds, control stream cap.
CANCEL_LUA = """
redis.call('HSET', KEYS[1], 'cancel', '1', 'cancel_at', ARGV[2])
if redis.call('TTL', KEYS[1]) < 0 then
  redis.call('EXPIRE', KEYS[1], ARGV[3])
end
return redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', 'op', 'cancel', 'id', ARGV[1])
"""


def build_request(prompt: Optional[str] = None, *, messages: Optional[list] = None,
                  model: Optional[str] = None, priority: int = 0, job_id: Optional[str] = None,
                  deadline: Optional[float] = None, metadata: Optional[dict] = None,
                  **sampling: Any) -> JobRequest:
    """Validate a submission locally so mistakes fail at the caller, with the worker's message."""
    data: dict[str, Any] = dict(sampling, prompt=prompt, model=model, priority=priority,
                                deadline=deadline, metadata=metadata)
    if messages is not None:
        data["messages"] = [m.model_dump() if isinstance(m, ChatMessage) else m for m in messages]
    if job_id is not None:
        data["id"] = job_id
    try:
        return JobRequest.model_validate({k: v for k, v in data.items() if v is not None})
    except ValidationError as e:
        raise ValueError(f"invalid job request: {describe_validation_error(e)}") from e


def submit_args(req: JobRequest, ttl_s: int = JOB_TTL_S) -> list:
    return [req.to_wire(), req.lane, f"{time.time():.6f}", ttl_s]


def cancel_args(job_id: str, ttl_s: int = JOB_TTL_S) -> list:
    return [job_id, f"{time.time():.6f}", ttl_s, CONTROL_MAXLEN]


def decode_event(fields: dict) -> Any:
    return _parse_event(fields["event"])


def events_in(xread_reply) -> Iterator[tuple[str, Any]]:
    """(entry id, decoded event) for every entry of an XREAD reply (None when it timed out)."""
    for _, entries in xread_reply or []:
        for entry_id, fields in entries:
            yield entry_id, decode_event(fields)


def terminal_from_hash(result: Optional[str], error: Optional[str]
                       ) -> Optional[Union[ResultEvent, ErrorEvent]]:
    if result:
        return ResultEvent.model_validate_json(result)
    if error:
        return ErrorEvent.model_validate_json(error)
    return None


def last_terminal(xrevrange_reply) -> Optional[Union[ResultEvent, ErrorEvent]]:
    """The stream's last event when it is terminal (covers a hash that expired or was never
    written by a non-genpool worker)."""
    if not xrevrange_reply:
        return None
    ev = decode_event(xrevrange_reply[0][1])
    return ev if ev.type in ("result", "error") else None


def backoff(first: float = 0.05, cap: float = 2.0) -> Iterator[float]:
    delay = first
    while True:
        yield delay
        delay = min(cap, delay * 2)


def block_ms(deadline: Optional[float]) -> int:
    """XREAD BLOCK for the time left (BLOCK 0 would mean forever, so never return 0)."""
    if deadline is None:
        return READ_BLOCK_MS
    return max(1, min(READ_BLOCK_MS, int((deadline - time.monotonic()) * 1000)))
