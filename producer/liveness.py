"""Which live workers serve which models: read from the workers hash and the heartbeat keys.

A worker's info entry (workers/heartbeat.py; schemas/workers.py WorkerInfo) names every model
name it accepts in `model` (comma-separated, its primary name and aliases), its primary name in
`model_name`, and the heartbeat key with a TTL tells whether it is alive. An entry that does not
parse is left out, with its reason logged once. Shared by the sync client, the asyncio client
and the gateway (redis + pydantic only).
"""
from __future__ import annotations

import logging
from typing import Optional

from genpool.schemas import Keys
from genpool.schemas.workers import WorkerInfo, parse_worker_info

log = logging.getLogger("genpool.producer")
_warned: set[tuple[str, str]] = set()  # (worker, why) already logged: a check runs every few s


def _name(field) -> str:
    return field.decode("utf-8", "replace") if isinstance(field, bytes) else str(field)


def read_infos(infos: dict) -> tuple[dict[str, WorkerInfo], dict[str, str]]:
    """HGETALL of the workers hash, parsed: ({name: info}, {name: why it does not parse})."""
    good, bad = {}, {}
    for field, doc in infos.items():
        name = _name(field)
        info, why = parse_worker_info(doc, name)
        if info is None:
            bad[name] = why
        else:
            good[name] = info
    return good, bad


def parse_infos(infos: dict, alive: list) -> list[WorkerInfo]:
    """Live workers' infos from HGETALL of the workers hash and EXISTS of each heartbeat (in the
    hash's order); unparsable entries are skipped, their reason logged once."""
    good, bad = read_infos(infos)
    for name, why in bad.items():
        if (name, why) not in _warned:
            _warned.add((name, why))
            log.warning("worker %s: its heartbeat document is unreadable, ignored: %s", name, why)
    return [good[_name(f)] for f, up in zip(infos, alive) if up and _name(f) in good]


def served_names(info: WorkerInfo) -> set[str]:
    return info.served_names()


def serving(live: list[WorkerInfo], model: Optional[str]) -> list[WorkerInfo]:
    """The live workers that would take a job for `model` (None: any model); not draining."""
    return [w for w in live if w.serves(model)]


def live_workers(r, keys: Keys) -> list[WorkerInfo]:
    infos = r.hgetall(keys.workers)
    if not infos:
        return []
    pipe = r.pipeline(transaction=False)
    for name in infos:
        pipe.exists(keys.worker(_name(name)))
    return parse_infos(infos, pipe.execute())


async def live_workers_async(r, keys: Keys) -> list[WorkerInfo]:
    infos = await r.hgetall(keys.workers)
    if not infos:
        return []
    pipe = r.pipeline(transaction=False)
    for name in infos:
        pipe.exists(keys.worker(_name(name)))
    return parse_infos(infos, await pipe.execute())
