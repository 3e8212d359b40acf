"""Which live workers serve which models: read from the workers hash and the heartbeat keys.

A worker's info entry (workers/heartbeat.py) names every model name it accepts in `model`
(comma-separated, its primary name and aliases), its primary name in `model_name`, and the
heartbeat key with a TTL tells whether it is alive. Shared by the sync client, the asyncio
client and the gateway (redis + pydantic only).
"""
from __future__ import annotations

import json
from typing import Optional

from genpool.schemas import Keys


def parse_infos(infos: dict, alive: list) -> list[dict]:
    """Live workers' info dicts from HGETALL of the workers hash and EXISTS of each heartbeat."""
    out = []
    for (name, doc), up in zip(infos.items(), alive):
        if not up:
            continue
        try:
            info = json.loads(doc)
        except (ValueError, TypeError):
            continue
        if isinstance(info, dict):
            info["name"] = name.decode() if isinstance(name, bytes) else str(name)
            out.append(info)
    return out


def served_names(info: dict) -> set[str]:
    return {m for m in str(info.get("model") or "").split(",") if m}


def serving(live: list[dict], model: Optional[str]) -> list[dict]:
    """The live workers that would take a job for `model` (None: any model)."""
    if model is None:
        return [w for w in live if w.get("state") != "draining"]
    return [w for w in live if model in served_names(w) and w.get("state") != "draining"]


def live_workers(r, keys: Keys) -> list[dict]:
    infos = r.hgetall(keys.workers)
    if not infos:
        return []
    pipe = r.pipeline(transaction=False)
    for name in infos:
        pipe.exists(keys.worker(name.decode() if isinstance(name, bytes) else name))
    return parse_infos(infos, pipe.execute())


async def live_workers_async(r, keys: Keys) -> list[dict]:
    infos = await r.hgetall(keys.workers)
    if not infos:
        return []
    pipe = r.pipeline(transaction=False)
    for name in infos:
        pipe.exists(keys.worker(name.decode() if isinstance(name, bytes) else name))
    return parse_infos(infos, await pipe.execute())
