"""Turning a raw lane-stream entry into a job, or into a precise reason why it cannot run.

Nothing here touches Redis or the engine, so every hostile input can be unit-tested. An entry that
fails yields either an error for the job's own stream (when a job id can be recovered, so its
reader learns what was wrong) or a dead-letter reason (when nobody could be told).
"""
from __future__ import annotations

import json
import re
from typing import Optional

from pydantic import ValidationError

from genpool.schemas import ErrorEvent, JobRequest, describe_validation_error
from genpool.schemas.keys import JOB_ID_CHARS
from genpool.schemas.keys import JOB_ID_RE as _VALID_ID
from genpool.workers.job import Entry, Job, _b

__all__ = ["Entry", "MAX_PAYLOAD_BYTES", "parse_entry"]

# a JSON string (escapes skipped whole) or a bracket: what _recover_id walks, in C, not per byte
_TOKEN_RE = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[{}\[\]]', re.S)
_ID_VALUE_RE = re.compile(rb'\s*:\s*"(' + JOB_ID_CHARS.encode() + rb')"')
MAX_PAYLOAD_BYTES = 8 << 20  # a request above this is refused before any JSON parsing
# strings and brackets _recover_id looks at, at most: ~40 ms of the engine loop (a real job's
# messages are a few tokens each; 8 MB of "[" would take seconds)
_RECOVER_TOKENS = 200_000


def _recover_id(raw: bytes) -> Optional[str]:
    """The top-level "id" of an entry that does not parse (bad UTF-8, cut short, too big), or
    None. Only the outer object's key counts: an "id" in metadata or a tool call names another
    job or none, and an error sent there would leave this job unanswered."""
    raw, stack = raw[:MAX_PAYLOAD_BYTES], []
    for n, m in enumerate(_TOKEN_RE.finditer(raw)):
        if n == _RECOVER_TOKENS:  # a flood of brackets: give up (the entry is dead-lettered)
            return None
        tok = m.group()
        if tok in (b"{", b"["):
            stack.append(tok)
        elif tok in (b"}", b"]"):
            if not stack:
                return None
            stack.pop()
        elif tok == b'"id"' and stack == [b"{"]:
            v = _ID_VALUE_RE.match(raw, m.end())
            if v:
                return v.group(1).decode()
    return None


def _fail(entry: Entry, job_id: Optional[str], code: str, message: str) -> Job:
    if job_id:
        return _job(entry, job_id=job_id, error=ErrorEvent(code=code, message=message))
    return _job(entry, dead_reason=message)


def _job(entry: Entry, **parsed) -> Job:
    return Job(entry, **parsed)


def parse_entry(entry: Entry, served_models: frozenset[str]) -> Job:
    """Validate one entry against the protocol and this worker's model names."""
    raw = entry.payload()
    if raw is None:
        names = ", ".join(sorted(_b(k) for k in entry.fields))[:200]
        return _job(entry, dead_reason=f"entry has no 'job' field (fields: {names or 'none'})")
    if len(raw) > MAX_PAYLOAD_BYTES:
        return _fail(entry, _recover_id(raw), "invalid_request",
                     f"job is {len(raw)} bytes; the limit is {MAX_PAYLOAD_BYTES}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return _fail(entry, _recover_id(raw), "invalid_request",
                     f"job is not valid UTF-8: byte 0x{raw[e.start]:02x} at offset {e.start}")
    try:
        obj = json.loads(text)
    except ValueError as e:  # JSONDecodeError and RecursionError-free ValueErrors
        return _fail(entry, _recover_id(raw), "invalid_request", f"job is not valid JSON: {e}")
    except RecursionError:
        return _fail(entry, _recover_id(raw), "invalid_request", "job JSON is nested too deeply")
    return _validate(entry, obj, served_models)


def _validate(entry: Entry, obj, served_models: frozenset[str]) -> Job:
    if not isinstance(obj, dict):
        return _job(entry, dead_reason=f"job must be a JSON object, got {type(obj).__name__}")
    job_id = obj.get("id")
    if not (isinstance(job_id, str) and _VALID_ID.match(job_id)):
        why = "missing 'id'" if job_id is None else f"invalid 'id' {str(job_id)[:80]!r}"
        return _job(entry, dead_reason=f"job has {why}: nobody could read its result "
                                         "(ids are 1-128 of [A-Za-z0-9_.-])")
    try:
        req = JobRequest.model_validate(obj)
    except ValidationError as e:
        return _fail(entry, job_id, "invalid_request", describe_validation_error(e))
    except RecursionError:  # a validator's own parsing of a nested field: this job's error, not the worker's
        return _fail(entry, job_id, "invalid_request", "job is nested too deeply")
    if req.model is not None and req.model not in served_models:
        return _fail(entry, job_id, "unknown_model",
                     f"model {req.model!r} is not served here; this pool serves "
                     f"{', '.join(sorted(served_models))}")
    return _job(entry, req=req, job_id=job_id)
