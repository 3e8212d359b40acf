"""One way to run genpool's Lua scripts (schemas/scripts.py), for workers and producers alike.

`Script(body)` knows its SHA1 up front, so nothing is loaded until a server says it lacks the
script. Then, and only then, it is loaded and the call sent again: after a Redis restart, a
failover to a replica that never saw SCRIPT LOAD, or a SCRIPT FLUSH. On a Redis Cluster the
body travels with EVAL (redis-py's cluster pipeline refuses EVALSHA; Redis still caches the
compiled script, so the cost is the body's bytes). redis-py's own `register_script` is not used:
on a pipeline it costs a SCRIPT EXISTS round trip on every execute().

Immediate calls: `script(r, keys, args)` (sync) or `await script.acall(r, keys, args)` (asyncio).
Pipelines: `script.queue(pipe, keys, args)` for each call, then `pipelined(r, items, queue)`
(asyncio: `await apipelined(...)`), which resends exactly the calls answered NoScriptError once
their scripts are loaded.
"""
from __future__ import annotations

import hashlib
from typing import Any, Callable, Iterable, Sequence

import redis

from .connection import REDIS_DOWN, is_cluster


class Script:
    """One Lua script body, callable on a client or queued on a pipeline."""

    def __init__(self, body: str):
        self.body = body
        self.sha = hashlib.sha1(body.encode()).hexdigest()

    def __repr__(self) -> str:
        return f"Script({self.sha[:12]})"

    def _command(self, client, keys: Sequence, args: Sequence) -> tuple:
        if is_cluster(client):
            return ("EVAL", self.body, len(keys), *keys, *args)
        return ("EVALSHA", self.sha, len(keys), *keys, *args)

    def __call__(self, r, keys: Sequence = (), args: Sequence = ()) -> Any:
        try:
            return r.execute_command(*self._command(r, keys, args))
        except redis.exceptions.NoScriptError:
            r.script_load(self.body)
            return r.execute_command(*self._command(r, keys, args))

    async def acall(self, r, keys: Sequence = (), args: Sequence = ()) -> Any:
        try:
            return await r.execute_command(*self._command(r, keys, args))
        except redis.exceptions.NoScriptError:
            await r.script_load(self.body)
            return await r.execute_command(*self._command(r, keys, args))

    def queue(self, pipe, keys: Sequence = (), args: Sequence = ()) -> None:
        pipe.execute_command(*self._command(pipe, keys, args))


def pipelined(r, items: list, queue: Callable[[Any, Any], None], scripts: Iterable[Script] = (),
              raise_errors: bool = False) -> list:
    """One pipeline of `queue(pipe, item)` (one command each) for every item; the answers in
    order, errors as values. A lost connection is raised. Calls answered NoScriptError are sent
    again once `scripts` are loaded. With `raise_errors`, the first error left is raised."""
    if not items:
        return []
    res = _send(r, items, queue)
    retry = _no_script(res)
    if retry:
        for sc in scripts:
            r.script_load(sc.body)
        for i, x in zip(retry, _send(r, [items[i] for i in retry], queue)):
            res[i] = x
    return _checked(res, raise_errors)


async def apipelined(r, items: list, queue: Callable[[Any, Any], None],
                     scripts: Iterable[Script] = (), raise_errors: bool = False) -> list:
    """pipelined() on an asyncio client (queue() stays sync: queueing sends nothing)."""
    if not items:
        return []
    res = await _asend(r, items, queue)
    retry = _no_script(res)
    if retry:
        for sc in scripts:
            await r.script_load(sc.body)
        for i, x in zip(retry, await _asend(r, [items[i] for i in retry], queue)):
            res[i] = x
    return _checked(res, raise_errors)


def _no_script(res: list) -> list[int]:
    return [i for i, x in enumerate(res) if isinstance(x, redis.exceptions.NoScriptError)]


def _checked(res: list, raise_errors: bool) -> list:
    for x in res:
        if isinstance(x, REDIS_DOWN) or (raise_errors and isinstance(x, Exception)):
            raise x
    return res


def _send(r, items: list, queue) -> list:
    pipe = r.pipeline(transaction=False)
    for item in items:
        queue(pipe, item)
    return pipe.execute(raise_on_error=False)


async def _asend(r, items: list, queue) -> list:
    pipe = r.pipeline(transaction=False)
    for item in items:
        queue(pipe, item)
    return await pipe.execute(raise_on_error=False)
