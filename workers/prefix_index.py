"""The pool's prefix index in Redis (prefix-aware routing; the worker's side: workers/router.py).

Every worker publishes, about once a second (`prefix_index_s`), what its prefix cache holds: the
chain hashes of its cached full KV blocks (engine/block_manager.py; at most INDEX_CAP of them) as
a Redis SET with a TTL, plus a small load summary (free slots, hand-off backlog, computed tokens
per job) and its publish time. A reader asks, in one pipeline, how long a prefix of a prompt each
fresh peer caches. Every key is built by schemas/keys.py and carries the `{<prefix>}` hash tag, so
one lookup over all workers is one slot on a Redis Cluster.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

from genpool.schemas.routing import PeerLoad, parse_peer_load

log = logging.getLogger("genpool.worker")

INDEX_CAP = 4096  # block hashes a worker publishes (the most recently cached ones)
REGISTRY_TTL_S = 3600  # the shared zset/hash of routing workers (refreshed by every publish)
PRUNE_AFTER_S = 600  # a worker silent this long is removed from the routing registry


class PrefixIndex:
    """Publish this worker's summary; read the fresh peers' summaries and cached prefixes."""

    def __init__(self, r, keys, name: str, interval_s: float, touch_s: float = 1.0):
        self.r, self.keys, self.name = r, keys, name
        self.interval_s = interval_s
        # freshness: the loop publishes between engine steps (which can take seconds on a loaded
        # CPU), so the lease thread also touches the publish time at every heartbeat (touch_s):
        # a live worker stays fresh through a long step; a dead or stopped one goes stale
        self.stale_s = max(3 * interval_s, 3 * touch_s, 3.0)
        self.ttl_s = max(5, int(10 * interval_s + 1))
        self._published: Optional[set[int]] = None  # what the SET holds (None: rewrite it all)
        self.publishes = 0
        self._bad: set[bytes] = set()  # peers left out for a bad entry, already warned about

    def publish(self, hashes: list[int], load: PeerLoad) -> None:
        """Bring the SET to `hashes` by difference (never empty in between: a reader racing a
        publish sees old or new blocks, not none), and the load summary with its time."""
        key, now = self.keys.prefix_index(self.name), time.time()
        new = set(hashes)
        pipe = self.r.pipeline(transaction=False)
        if self._published is None:
            pipe.delete(key)
            add, drop = new, set()
        else:
            add, drop = new - self._published, self._published - new
        if add:
            pipe.sadd(key, *add)
        if drop:
            pipe.srem(key, *drop)
        pipe.expire(key, self.ttl_s)
        # through the model readers parse with, so what a worker publishes always reads back
        pipe.hset(self.keys.route_load, self.name, load.model_copy(update={"at": now}).model_dump_json())
        pipe.zadd(self.keys.route_workers, {self.name: now})
        pipe.expire(self.keys.route_load, REGISTRY_TTL_S)
        pipe.expire(self.keys.route_workers, REGISTRY_TTL_S)
        res = pipe.execute()
        exists = res[-5]  # EXPIRE of the block SET: 0 when it did not exist (expired meanwhile)
        self._published = new if (exists or not new) else None
        self.publishes += 1
        if self.publishes % 60 == 1:
            self._prune(now)

    def touch(self) -> None:
        """From the lease thread: still alive (only once the loop has published)."""
        if self.publishes:
            self.r.zadd(self.keys.route_workers, {self.name: time.time()}, xx=True)

    def _prune(self, now: float) -> None:
        old = self.r.zrangebyscore(self.keys.route_workers, "-inf", now - PRUNE_AFTER_S)
        if old:
            pipe = self.r.pipeline(transaction=False)
            pipe.zrem(self.keys.route_workers, *old)
            pipe.hdel(self.keys.route_load, *old)
            pipe.execute()

    def leave(self) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.delete(self.keys.prefix_index(self.name))
        pipe.zrem(self.keys.route_workers, self.name)
        pipe.hdel(self.keys.route_load, self.name)
        pipe.execute()
        self._published = None

    def peers(self) -> tuple[dict[str, PeerLoad], int]:
        """({name: load} of the fresh peers, how many registered peers were left out: stale,
        without a load entry, or with one that does not parse)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.zrange(self.keys.route_workers, 0, -1, withscores=True)
        pipe.hgetall(self.keys.route_load)
        members, loads = pipe.execute()
        now, fresh, left_out = time.time(), {}, 0
        loads = {_raw(k): v for k, v in loads.items()}
        for member, at in members:
            name = _raw(member)
            if name == self.name.encode():
                continue
            load = self._parse(name, loads.get(name))
            if load is None or now - float(at) > self.stale_s:
                left_out += 1
                continue
            fresh[name.decode()] = load
        self._bad &= set(loads)  # gone: a bad entry under that name later is news again
        return fresh, left_out

    def _parse(self, name: bytes, raw: Optional[bytes]) -> Optional[PeerLoad]:
        """The peer's load, or None. Anyone can HSET the hash, so a bad entry costs only its
        peer: left out of routing, with one warning until it parses again (not one per job
        routed, nor per publish of a buggy peer)."""
        try:
            name.decode()  # (the name becomes part of keys and consumer names)
            load, why = parse_peer_load(raw)
        except UnicodeDecodeError:
            load, why = None, "its name is not UTF-8"
        if load is not None:
            self._bad.discard(name)
        elif raw is not None and name not in self._bad:
            self._bad.add(name)
            log.warning("prefix routing: leaving peer %r out: its routing entry does not parse "
                        "(%s): %.200r", name.decode(errors="replace"), why, raw)
        return load

    def cached_tokens(self, names: list[str], hash_lists: list[list[int]],
                      block_size: int) -> list[dict[str, int]]:
        """For each prompt's chain hashes: {peer: tokens of its longest cached prefix}. One
        pipeline of SMISMEMBER, one per (prompt, peer); a chain counts up to its first miss."""
        pipe = self.r.pipeline(transaction=False)
        work = [(i, n) for i, hs in enumerate(hash_lists) if hs for n in names]
        for i, n in work:
            pipe.smismember(self.keys.prefix_index(n), hash_lists[i])
        out: list[dict[str, int]] = [{} for _ in hash_lists]
        for (i, n), flags in zip(work, pipe.execute() if work else []):
            hit = 0
            for f in flags:
                if not int(f):
                    break
                hit += 1
            out[i][n] = hit * block_size
        return out


def _raw(v) -> bytes:
    return v if isinstance(v, bytes) else str(v).encode()
