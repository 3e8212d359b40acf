"""The worker's side of fair pull (issue 31): FAIR_READ_LUA's keys and arguments for one lane
shard, and what upkeep must know of the tenants' sub-streams.

The scheduling itself runs in Redis (schemas/tenant_scripts.py), on state every worker shares,
so the pool as a whole serves backlogged tenants in weighted fair order. Here: the tenants'
weights (read every upkeep) and the sub-streams that may hold pending entries, which reclaim and
a restarted worker's own-pending check must look at beside the lane streams.
"""
from __future__ import annotations

from typing import Collection

from genpool.schemas import Keys
from genpool.schemas.keys import GROUP, field_int
from genpool.schemas.keys import field_text as _s
from genpool.schemas.scripting import Script
from genpool.schemas.tenant_scripts import FAIR_READ_LUA
from genpool.schemas.tenants import (
    DEFAULT_COST,
    FAIR_QUANTUM,
    FAIR_STATE_TTL_S,
    TENANT_RE,
    TenantKeys,
    known_sub_streams,
    queue_known,
)

FAIR_READ = Script(FAIR_READ_LUA)
IDLE_BLOCK_MS = 50  # an idle worker's blocking read, while tenants exist (sub-streams wake none)




class FairPull:
    def __init__(self, name: str):
        self.name = name
        self.weights: dict[str, int] = {}
        self.sub_streams: list[str] = []  # every known tenant's sub-stream of every lane

    def queue_read(self, pipe, keys: Keys, shard: int, high: int, free: int,
                   full: Collection[str] = ()) -> None:
        """FAIR_READ_LUA on one lane shard, on `pipe` (READ_LUA's budgets and reply); the
        tenants `full` (at their concurrency cap: workers/caps.py) are skipped this time."""
        lanes, t = keys.shard_lanes(shard), TenantKeys(keys)
        state = [k for lane in lanes for k in (t.fair(lane)[0], t.fair(lane)[1], t.fair(lane)[3])]
        weighted = {**self.weights, **dict.fromkeys(full, 0)}
        weights = [x for tenant, w in sorted(weighted.items()) for x in (tenant, w)]
        FAIR_READ.queue(pipe, [*lanes, *state], [GROUP, self.name, high, free, FAIR_QUANTUM,
                                                  DEFAULT_COST, FAIR_STATE_TTL_S, *weights])

    def refresh(self, r, keys: Keys) -> None:
        """Learn the known tenants' sub-streams and the weights (one pipelined round trip)."""
        pipe = r.pipeline(transaction=False)
        queue_known(pipe, keys)
        pipe.hgetall(TenantKeys(keys).weights)
        *known, weights = pipe.execute()
        self.sub_streams = known_sub_streams(keys, known)
        self.weights = {_s(k): w for k, v in weights.items()
                        if TENANT_RE.match(_s(k)) and 1 <= (w := field_int(v) or 0) <= 1000}

    def idle_block_ms(self, block_ms: int) -> int:
        return min(block_ms, IDLE_BLOCK_MS) if self.sub_streams else block_ms
