"""What keeps one task message from taking a Celery worker of this app down.

Celery trusts task messages: it unpacks them unchecked, some of it in the consumer's own thread,
where one error ends the whole worker (or, a KeyError, counts as a lost broker connection and
loops it through reconnects), and the message, never acknowledged, goes back on the queue to do
the same to the next worker. So every worker process of the app (`genpool worker --celery` and
the plain `celery -A genpool.workers.integrations.celery_app worker` forwarder) consumes through
GuardedConsumer, which checks a message's shape before Celery reads it: one it cannot read is
rejected and logged with what was wrong. And GuardedTask keeps an error in Celery's own handling
of a task's outcome, in a pool thread, from leaving its message unacknowledged for good.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from billiard.einfo import ExceptionInfo
from celery import Task
from celery.app.task import Context
from celery.app.trace import trace_ok_t
from celery.exceptions import InvalidTaskError
from celery.worker.consumer import Consumer

log = logging.getLogger("genpool.celery")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is(value: Any, kind: str) -> bool:
    """Whether a decoded JSON value is of a protocol field's kind (JSON null is always fine)."""
    if value is None:
        return True
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "limits":  # [soft, hard] seconds
        return isinstance(value, list) and len(value) == 2 and all(
            v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in value)
    if kind == "names":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    return isinstance(value, {"str": str, "bool": bool, "object": dict, "array": list}[kind])


# Celery's task protocol 2 headers (docs.celeryq.dev, internals/protocol) and their JSON kinds.
# Celery reads them unchecked, some in the consumer's own thread: a wrong kind there ends the
# worker, elsewhere it leaves the message unacknowledged for good, holding a pool slot.
HEADERS = {**dict.fromkeys(("lang", "task", "id", "root_id", "parent_id", "group", "meth",
                            "shadow", "eta", "expires", "argsrepr", "kwargsrepr", "origin"), "str"),
           **dict.fromkeys(("retries", "group_index", "replaced_task_nesting"), "int"),
           "ignore_result": "bool", "redelivered": "bool", "timelimit": "limits",
           "stamped_headers": "names", "stamps": "object"}
# Other headers (tracing ones, a caller's own) are kept, except the names of the task's request
# context, into which Celery merges every header (a `chain` header would run as one).
RESERVED = frozenset(k for k, v in vars(Context).items()
                     if not k.startswith("_") and not callable(v)) - HEADERS.keys()
EMBED = {"callbacks": "array", "errbacks": "array", "chain": "array", "chord": "object"}
SIGNATURE = {"task": "str", "args": "array", "kwargs": "object", "options": "object",
             "subtask_type": "str", "immutable": "bool"}
KINDS = {"str": "a string", "int": "an integer", "bool": "true or false", "object": "an object",
         "array": "an array", "limits": "[soft, hard] seconds", "names": "an array of strings"}


def _fields_problem(doc: dict, kinds: dict, what: str) -> Optional[str]:
    for name, kind in kinds.items():
        if not _is(doc.get(name), kind):
            return f"{what} {name!r} must be {KINDS[kind]} or null (got {_short(doc[name])})"
    return None


def _embed_problem(embed: Any) -> Optional[str]:
    """embed: what runs after the task (callbacks, errbacks, chain: signature lists; chord)."""
    if not _is(embed, "object"):
        return f"embed must be a JSON object or null (got {_short(embed)})"
    embed = embed or {}
    unknown = sorted(set(embed) - EMBED.keys())  # each would land in the request context too
    if unknown:
        return f"unknown embed field {unknown[0]!r}"
    problem = _fields_problem(embed, EMBED, "embed")
    if problem:
        return problem
    sigs = [*(embed.get("callbacks") or []), *(embed.get("errbacks") or []),
            *(embed.get("chain") or []), *([embed["chord"]] if embed.get("chord") else [])]
    for sig in sigs:
        if not isinstance(sig, dict) or not isinstance(sig.get("task"), str):
            return f"embed signatures must be JSON objects naming a task (got {_short(sig)})"
        problem = _fields_problem(sig, SIGNATURE, "signature field")
        if problem:
            return problem
    return None


def _body_problem(payload: Any) -> Optional[str]:
    if isinstance(payload, dict) and "args" in payload:  # protocol 1 or the hybrid 1/2 form
        args, kwargs = payload.get("args", []), payload.get("kwargs", {})
        embed = {k: payload[k] for k in EMBED if k in payload}
    elif isinstance(payload, list) and len(payload) == 3:
        args, kwargs, embed = payload
    else:
        return f"body must be a JSON array [args, kwargs, embed] (got {_short(payload)})"
    if not isinstance(args, list):
        return f"args must be a JSON array (got {_short(args)})"
    if not isinstance(kwargs, dict):
        return f"kwargs must be a JSON object (got {_short(kwargs)})"
    return _embed_problem(embed)


def message_problem(headers: dict, payload: Any) -> Optional[str]:
    """What in a task message (protocol 2: the envelope in the headers, the body `[args,
    kwargs, embed]`; protocol 1: all in a body object) Celery's request handling cannot read.
    None: nothing (or no task message at all, which Celery reports and drops itself)."""
    if "task" not in headers:  # protocol 1, or not a task message
        if not (isinstance(payload, dict) and "task" in payload):
            return None
        headers = {k: v for k, v in payload.items() if k in HEADERS}
    if not (isinstance(headers.get("id"), str) and headers["id"]):
        # read unchecked; a KeyError there even counts as a lost broker connection: the
        # consumer reconnects and gets the same message back, forever
        return f"header 'id' must be a non-empty string (got {_short(headers.get('id'))})"
    reserved = sorted(RESERVED & headers.keys())
    if reserved:
        return f"header {reserved[0]!r} is not a task message header"
    return _fields_problem(headers, HEADERS, "header") or _body_problem(payload)


class GuardedConsumer(Consumer):
    """Celery's consumer, which first checks that it can read a task message: one it cannot
    is rejected (not requeued) and logged with what was wrong, as Celery does for an invalid
    ETA, instead of ending the worker. (app.conf.worker_consumer names this class.)"""

    def create_task_handler(self, *args, **kwargs):
        handle = super().create_task_handler(*args, **kwargs)

        def on_task_received(message):
            try:
                headers, payload = message.headers, message.decode()
            except Exception:  # not decodable (bad JSON, pickle...): Celery reports and drops it
                return handle(message)
            problem = message_problem(headers, payload) if isinstance(headers, dict) else None
            if problem is None:
                return handle(message)
            env = headers if "task" in headers or not isinstance(payload, dict) else payload
            try:  # raised, so that Celery's log line carries it
                raise InvalidTaskError(f"{_short(env.get('task'))} message "
                                       f"{_short(env.get('id'))}: {problem}")
            except InvalidTaskError as exc:
                return self.on_invalid_task(None, message, exc)

        return on_task_received


class GuardedTask(Task):
    """Base of genpool.generate. Its tracer (what a pool thread runs for a message) may raise
    out of Celery's failure handling, e.g. storing a failed chain's results under a malformed
    task id; the threads pool drops that error without settling the message, which then holds
    a pool slot until a restart redelivers it to do the same. Guarded, the task ends failed and
    its message is acknowledged. (Celery sets `__trace__` when the worker starts.)"""

    _tracer = None

    @property
    def __trace__(self):
        return self._tracer

    @__trace__.setter
    def __trace__(self, tracer) -> None:
        self._tracer = None if tracer is None else _guarded(tracer)


def _guarded(tracer):
    def trace(uuid, args, kwargs, request=None):
        try:
            return tracer(uuid, args, kwargs, request)
        except Exception as exc:
            log.error("task %s: Celery failed handling its outcome (%r); the task ends failed "
                      "and its message is acknowledged", uuid, exc, exc_info=True)
            return trace_ok_t(ExceptionInfo(), True, 0.0, repr(exc))  # -> Request.on_failure

    return trace
