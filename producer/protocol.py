"""Producer-side protocol pieces shared by the sync and async clients (no I/O here)."""
from __future__ import annotations

import json
import time
from typing import Any, Iterator, Optional, Union

from pydantic import ValidationError

from genpool.schemas import TERMINAL, ChatMessage, ErrorEvent, JobRequest, ResultEvent, describe_validation_error
from genpool.schemas import parse_event as _parse_event
from genpool.schemas.keys import CONTROL_MAXLEN, JOB_TTL_S  # noqa: F401 - re-exported for producers
from genpool.schemas.structured import check_structured, from_response_format, schema_of

READ_BLOCK_MS = 5_000
READ_COUNT = 1_000


def build_request(prompt: Optional[str] = None, *, messages: Optional[list] = None,
                  model: Optional[str] = None, priority: int = 0, job_id: Optional[str] = None,
                  deadline: Optional[float] = None, metadata: Optional[dict] = None,
                  response_format: Optional[dict] = None, json_schema: Any = None,
                  **sampling: Any) -> JobRequest:
    """Validate a submission locally so mistakes fail at the caller, with the worker's message.
    Structured output: `structured_outputs={...}` (vLLM's names), or OpenAI's `response_format`,
    or `json_schema=` a schema dict / JSON text / pydantic model class."""
    data: dict[str, Any] = dict(sampling, prompt=prompt, model=model, priority=priority,
                                deadline=deadline, metadata=metadata)
    data["structured_outputs"] = _structured(data.get("structured_outputs"), response_format,
                                             json_schema)
    if messages is not None:
        data["messages"] = [m.model_dump() if isinstance(m, ChatMessage) else m for m in messages]
    if job_id is not None:
        data["id"] = job_id
    try:
        req = JobRequest.model_validate({k: v for k, v in data.items() if v is not None})
    except ValidationError as e:
        raise ValueError(f"invalid job request: {describe_validation_error(e)}") from e
    problem = req.structured_outputs and check_structured(req.structured_outputs)
    if problem:
        raise ValueError(f"invalid job request: {problem}")
    return req


def _structured(so: Any, response_format: Any, json_schema: Any) -> Any:
    given = [n for n, v in (("structured_outputs", so), ("response_format", response_format),
                            ("json_schema", json_schema)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"invalid job request: give one of {' or '.join(given)}")
    if response_format is not None:
        try:
            return from_response_format(response_format)
        except ValueError as e:
            raise ValueError(f"invalid job request: {e}") from None
    if json_schema is not None:
        return {"json": schema_of(json_schema)}
    return so


def submit_args(req: JobRequest, ttl_s: int = JOB_TTL_S) -> list:
    """SUBMIT_LUA's arguments (its keys: producer/fair_submit.py submit_keys)."""
    from .fair_submit import fair_args

    return [req.to_wire(), req.lane, f"{time.time():.6f}", ttl_s, req.tenant, *fair_args(req)]


def cancel_args(job_id: str, ttl_s: int = JOB_TTL_S) -> list:
    return [job_id, f"{time.time():.6f}", ttl_s, CONTROL_MAXLEN]


def cancel_broadcast(job_id: str) -> dict:
    """Fields of the control-stream entry that stops a running job (CANCEL_LUA writes the same)."""
    return {"op": "cancel", "id": job_id}


def decode_event(fields) -> Any:
    """An entry's event, or None for one a reader skips: an unknown type (a later worker may add
    types, as it may add fields), or an entry no worker of this version writes (garbage, no event,
    a null where a number belongs) unless it claims to end the job. The result comes whole at the
    end, so a skipped token loses nothing from `result()`. A result or error that does not parse
    is the job's `internal` error. Never an exception out of a reader: the gateway answered a
    500, and a batch holding the job could never finish."""
    if isinstance(fields, list):  # redis-py's cluster MULTI leaves stream replies unparsed
        fields = dict(zip(fields[0::2], fields[1::2]))
    raw = fields.get("event")
    try:
        return _parse_event(raw)
    except (TypeError, ValueError) as e:  # pydantic's ValidationError is a ValueError
        return unreadable(e) if _claimed_type(raw) in TERMINAL else None


def _claimed_type(raw) -> Optional[str]:
    try:
        kind = json.loads(raw).get("type")
    except (TypeError, ValueError, AttributeError, RecursionError):
        return None
    return kind if isinstance(kind, str) else None


def unreadable(error: Exception) -> ErrorEvent:
    """The job's error for an ending that cannot be read."""
    lines = str(error).splitlines() or [""]
    return ErrorEvent(code="internal", message=f"the job's end cannot be read ({type(error).__name__}: "
                                               f"{lines[0][:200]})")


def events_in(xread_reply) -> Iterator[tuple[str, Any]]:
    """(entry id, decoded event) for every entry of an XREAD reply (None when it timed out)."""
    for _, entries in xread_reply or []:
        for entry_id, fields in entries:
            ev = decode_event(fields)
            if ev is not None:  # skipped (decode_event)
                yield entry_id, ev


def terminal_from_hash(result: Optional[str], error: Optional[str]
                       ) -> Optional[Union[ResultEvent, ErrorEvent]]:
    try:
        if result:
            return ResultEvent.model_validate_json(result)
        if error:
            return ErrorEvent.model_validate_json(error)
    except ValueError as e:  # the job ended, but how cannot be read: its error, not the reader's exception
        return unreadable(e)
    return None


def last_terminal(xrevrange_reply) -> Optional[Union[ResultEvent, ErrorEvent]]:
    """The stream's last event when it is terminal (covers a hash that expired or was never
    written by a non-genpool worker)."""
    if not xrevrange_reply:
        return None
    ev = decode_event(xrevrange_reply[0][1])
    return ev if ev is not None and ev.type in TERMINAL else None
