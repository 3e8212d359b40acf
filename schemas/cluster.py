"""Redis Cluster clients whose "no node answers" is a lost connection (schemas/connection.py
builds them).

Every reconnect loop here (workers, readers, producers) waits out a redis.ConnectionError. When
no node of a cluster answers (every node down at once, e.g. a cluster restart), redis-py raises
a RedisClusterException instead, which those loops would die on:
- before 8.2, a bare RedisClusterException ("Redis Cluster cannot be connected") from the
  topology refresh;
- since 8.2, RedisClusterUnreachableError (a RedisClusterException subclass), also from every
  command, pipeline and transaction: after a refresh that reached no node, their
  ConnectionError/TimeoutError is re-raised as one, until a refresh reaches a node again.
The clients made here raise ClusterUnreachable (a ConnectionError) in all those places.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager

import redis

# redis-py 8.2+: its own class; before, a bare RedisClusterException with these words.
NO_NODE = getattr(redis.exceptions, "RedisClusterUnreachableError", None)


class ClusterUnreachable(redis.exceptions.ConnectionError):
    """No node of a Redis Cluster answers (every node down at once, e.g. a cluster restart)."""


def unreachable(e: BaseException) -> bool:
    """No node answers: a bare RedisClusterException before redis-py 8.2, its own class since."""
    return bool(NO_NODE and isinstance(e, NO_NODE)) or (
        type(e) is redis.exceptions.RedisClusterException and "cannot be connected" in str(e))


@contextmanager
def as_lost_connection():
    try:
        yield
    except redis.exceptions.RedisClusterException as e:
        if unreachable(e):
            raise ClusterUnreachable(str(e)) from e
        raise


def _sync(f):
    @functools.wraps(f)
    def wrapped(*a, **k):
        with as_lost_connection():
            return f(*a, **k)
    return wrapped


def _async(f):
    @functools.wraps(f)
    async def wrapped(*a, **k):
        with as_lost_connection():
            return await f(*a, **k)
    return wrapped


_CLASSES: dict = {}


def _converting(base: type, sync: tuple = (), aio: tuple = (), extra: dict | None = None) -> type:
    """A slot-compatible subclass of `base` (redis-py's asyncio cluster classes have __slots__:
    an instance can change class, not get a patched method) whose `sync` and `aio` methods raise
    ClusterUnreachable for "no node answers" (one class per base, made on first use)."""
    if base not in _CLASSES:
        body = {"__slots__": ()}
        body.update({name: _sync(getattr(base, name)) for name in sync})
        body.update({name: _async(getattr(base, name)) for name in aio})
        body.update(extra or {})
        _CLASSES[base] = type(base.__name__, (base,), body)
    return _CLASSES[base]


def _pipeline_of(base: type, aio: bool):
    def pipeline(self, *a, **k):
        pipe = base.pipeline(self, *a, **k)
        # execute_command queues, or (WATCH in a transaction) runs at once; both sync
        pipe.__class__ = (_converting(type(pipe), sync=("execute_command",), aio=("execute",))
                          if aio else _converting(type(pipe), sync=("execute_command", "execute")))
        return pipe
    return pipeline


def lost_connection_when_unreachable(r, aio: bool = False):
    """`r`, a fresh sync or asyncio RedisCluster, made to raise ClusterUnreachable (not
    RedisClusterException) wherever no node of the cluster answers: its topology refresh, its
    commands (scripts and scan_iter included) and its pipelines."""
    if type(r) in _CLASSES.values():
        return r
    manager = r.nodes_manager
    manager.__class__ = _converting(type(manager), **({"aio": ("initialize",)} if aio
                                                      else {"sync": ("initialize",)}))
    base = type(r)
    r.__class__ = _converting(base, **({"aio": ("execute_command",)} if aio
                                       else {"sync": ("execute_command",)}),
                              extra={"pipeline": _pipeline_of(base, aio)})
    return r
