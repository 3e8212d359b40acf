"""Prefix-aware routing in the worker: route new entries, hand them off, take handed-off ones.

A worker that pulls a NEW entry (read with ">") tokenizes it as before, then asks the prefix
index (workers/prefix_index.py) how long a prefix of the prompt each fresh peer caches;
workers/routing.py's pure `route()` picks where it runs. A job that should run elsewhere is
handed off without a new stream: the entry stays in its lane stream and its PENDING record is
moved to the peer's consumer name (XCLAIM <lane> workers <peer> 0 <id> JUSTID: one key, no
delivery charged). No lease has been taken yet (routing runs before CLAIM_LUA), and the puller
stops refreshing the entry in the same lock the lease keeper refreshes under.

The peer finds handed-off entries in its own PEL, holds them, queues them as its backlog and
admits them as capacity frees (its `Inbox`, workers/inbox.py); it never hands them on (only
entries read fresh are routed, so no job moves twice). If the peer dies or stalls, the
entry's idle time grows and the usual XAUTOCLAIM recovery gives it to another worker after
claim_idle_ms: nothing is lost, and the job hash's fencing keeps exactly one result.
"""
from __future__ import annotations

import logging
import time
from typing import Optional, Protocol

import redis

from genpool.engine.block_manager import prompt_block_hashes
from genpool.schemas import Keys
from genpool.schemas.routing import PeerLoad
from genpool.workers.inbox import Inbox
from genpool.workers.job import Job
from genpool.workers.lease import LeaseKeeper
from genpool.workers.prefix_index import INDEX_CAP, PrefixIndex
from genpool.workers.routing import HOWS, Candidate, RouteParams, route
from genpool.workers.worker_config import WorkerConfig

log = logging.getLogger("genpool.worker")


class RouterHost(Protocol):
    """What the router asks of the worker it routes for, and nothing more."""
    stopping: bool
    max_seqs: int

    @property
    def keys(self) -> Keys: ...  # a reconnect may widen the lane shards

    def capacity(self, backlog: bool = True) -> int: ...

    def jobs_taken(self) -> int: ...  # jobs ended or running, since the start


class Router:
    """The worker's side of routing: publish, route new entries; `inbox` takes handed-off ones."""

    def __init__(self, host: RouterHost, engine, r, cfg: WorkerConfig, keeper: LeaseKeeper):
        self.host, self.engine, self.r, self.keeper = host, engine, r, keeper
        self.name, self.model = cfg.name, ",".join(sorted(cfg.served_models))
        self.bm = engine.block_manager  # None: an engine without a prefix cache
        self.enabled = bool(cfg.prefix_routing and self.bm is not None
                            and self.bm.enable_prefix_caching)
        self.index = PrefixIndex(r, host.keys, cfg.name, cfg.prefix_index_s,
                                 min(cfg.heartbeat_s, cfg.claim_idle_ms / 3000))
        self.params = RouteParams(min_gain_tokens=cfg.route_min_gain_tokens)
        self.counts = {f"routed_{h}": 0 for h in HOWS}
        self.counts.update(handed_off=0, handed_in=0)
        # what peers hand us: found in our PEL, held, queued until capacity frees
        self.inbox = Inbox(r, keeper, cfg.name, self.enabled, lambda: host.keys, self.counts)
        self._next_publish = 0.0
        self._view: dict[str, PeerLoad] = {}
        self._view_stale = 0
        self._view_at = -1e9
        self._sent: dict[str, list[float]] = {}  # peer -> times of our hand-offs to it
        self._hit_rate: Optional[float] = None
        self._ema: Optional[float] = None  # computed prompt tokens per job, recently
        self._ema_mark = (0, 0)  # (jobs, computed tokens) when it was last updated

    @property
    def waiting(self) -> int:
        return len(self.inbox.backlog)

    # -- publishing --------------------------------------------------------------------------
    def publish_if_due(self) -> None:
        """On the loop's thread (it reads the block manager): about once per interval."""
        if time.monotonic() < self._next_publish:
            return
        self._next_publish = time.monotonic() + self.index.interval_s
        st = self.engine.stats()  # the heartbeat thread reads this snapshot, not the engine
        q = st.prefix_cache_queries
        self._hit_rate = round(st.prefix_cache_hits / q, 4) if q else None
        if self.enabled and not self.host.stopping:
            self.index.publish(self.bm.cached_hashes(INDEX_CAP), self.load())

    def touch(self) -> None:
        """The lease thread's heartbeat: keep our index fresh while a long step runs."""
        if self.enabled and not self.host.stopping:
            self.index.touch()

    def load(self) -> PeerLoad:
        return PeerLoad(free=self.host.capacity(), backlog=len(self.inbox.backlog),
                        slots=max(1, self.host.max_seqs),
                        job_tokens=round(self._own_job_tokens(), 1),
                        block_size=self.bm.block_size, model=self.model)

    # -- routing new entries -----------------------------------------------------------------
    def route(self, parsed: list[Job]) -> list[Job]:
        """Hand off the new entries a peer should run; returns the ones to run here."""
        if not self.enabled:
            return parsed
        bs = self.bm.block_size
        cands = [p for p in parsed if p.entry.origin == "new" and p.ok
                 and len(self._ids(p)) > 2 * bs]
        if not cands:
            return parsed
        hashes = [prompt_block_hashes(self._ids(p), bs) for p in cands]  # once: the index and our cache
        try:
            peers = self._peers()
            cached = self.index.cached_tokens(list(peers), hashes, bs)
            index_ok = bool(peers) or self._view_stale == 0
        except redis.RedisError as e:
            log.warning("prefix index unreadable (%s): running %d jobs here", e, len(cands))
            peers, cached, index_ok = {}, [{} for _ in cands], False
        local_free = max(1, self.host.capacity())
        gone: dict[str, list[Job]] = {}
        for p, hits, hs in zip(cands, cached, hashes):
            ids = self._ids(p)
            here = len(self.bm.find_cached_blocks(ids, hs)) * bs
            # what one job queued at a worker costs there: jobs wait in a backlog because that
            # worker caches them, so about what this job would cost there (its uncached tokens,
            # plus its generated tokens, as prompt-token equivalents)
            gen = p.req.max_tokens * p.req.n

            def per_job(cached: int) -> float:
                return max(len(ids) - cached, bs) + gen
            local = Candidate(self.name, here, local_free, len(self.inbox.backlog),
                              per_job(here), self.host.max_seqs)
            others = [Candidate(n, hits.get(n, 0), d.free, d.backlog, per_job(hits.get(n, 0)),
                                d.slots) for n, d in peers.items()]
            d = route(len(ids), local, others, p.entry.lane == "high", self.params, index_ok)
            self.counts[f"routed_{d.how}"] += 1
            log.debug("route %s: %s %s (cost %.0f, here %.0f; %d tokens, cached %s)", p.job_id,
                      d.how, d.target, d.cost, d.local_cost, len(ids),
                      {c.name: c.cached_tokens for c in [local, *others]})
            if d.handoff:
                gone.setdefault(d.target, []).append(p)
                _charge(peers[d.target], 1)  # what we sent counts until it publishes again
                self._sent.setdefault(d.target, []).append(time.time())
        if not gone:
            return parsed
        moved = self._hand_off(gone)
        return [p for p in parsed if id(p) not in moved]

    def _hand_off(self, gone: dict[str, list[Job]]) -> set[int]:
        entries = [p.entry for ps in gone.values() for p in ps]
        done: list = []

        def claim():
            pipe = self.r.pipeline(transaction=False)
            for peer, ps in gone.items():
                for p in ps:
                    pipe.xclaim(p.entry.stream, self.host.keys.group, peer, 0,
                                [p.entry.entry_id], justid=True)
            done.extend(pipe.execute())

        try:
            self.keeper.let_go(entries, claim)
        except redis.RedisError as e:  # unknown how far it got: hold them all again and run
            log.warning("hand-off failed (%s): running %d jobs here", e, len(entries))
            for ent in entries:  # them here (fencing settles a peer that also took one)
                self.keeper.hold(ent)
            for ps in gone.values():
                self.counts["routed_fallback"] += len(ps)
            return set()
        self.counts["handed_off"] += len(entries)
        for peer, ps in gone.items():
            log.debug("handed %d jobs to %s (cached prefix)", len(ps), peer)
        return {id(p) for ps in gone.values() for p in ps}

    def _peers(self) -> dict[str, PeerLoad]:
        """Fresh, compatible peers (cached for half a publish interval, with our hand-offs since
        each peer's last publish added to its backlog)."""
        now = time.monotonic()
        if now - self._view_at >= self.index.interval_s / 2:
            fresh, self._view_stale = self.index.peers()
            model, bs = self.model, self.bm.block_size
            self._view = {n: d for n, d in fresh.items() if d.model == model and d.block_size == bs}
            self._view_at = now
            for n, d in self._view.items():
                sent = [t for t in self._sent.get(n, []) if t > d.at]
                self._sent[n] = sent
                _charge(d, len(sent))
            for n in [n for n in self._sent if n not in self._view]:
                del self._sent[n]
        return self._view

    def _own_job_tokens(self) -> float:
        """Prompt tokens this engine computed per job it took, recently: a moving average over
        publish intervals (half weight each), so a cold start's misses fade within seconds.
        Updated at publish time only; routing reads the last value."""
        st = self.engine.stats()
        jobs = self.host.jobs_taken()
        computed = st.prefix_cache_queries - st.prefix_cache_hits
        last_jobs, last_computed = self._ema_mark
        if jobs > last_jobs:
            rate = max(0, computed - last_computed) / (jobs - last_jobs)
            self._ema = rate if self._ema is None else 0.5 * self._ema + 0.5 * rate
            self._ema_mark = (jobs, computed)
        return self._ema or 0.0

    @staticmethod
    def _ids(p: Job) -> list[int]:
        return (p.prompt or {}).get("prompt_token_ids") or []

    # -- leaving -----------------------------------------------------------------------------
    def leave(self) -> None:
        """Stop being a target; give the backlog to a fresh peer (or leave it pending for the
        usual reclaim if there is none)."""
        if not self.enabled:
            return
        try:
            self.index.leave()
            if self.inbox.backlog:
                self._view_at = -1e9
                peers = self._peers()
                target = min(peers, key=lambda n: peers[n].backlog, default=None)
                entries = list(self.inbox.backlog)
                self.inbox.backlog.clear()

                def claim():
                    if target is None:
                        return
                    pipe = self.r.pipeline(transaction=False)
                    for e in entries:
                        pipe.xclaim(e.stream, self.host.keys.group, target, 0, [e.entry_id],
                                    justid=True)
                    pipe.execute()
                self.keeper.let_go(entries, claim)
                log.info("gave %d handed-off jobs to %s", len(entries), target or "the reclaim")
        except redis.RedisError as e:
            log.warning("leaving the prefix index failed: %s", e)

    def status(self) -> dict:
        """For the heartbeat (another thread): counters and the loop's last snapshot only."""
        return {**self.counts, "backlog": len(self.inbox.backlog),
                "prefix_hit_rate": self._hit_rate, "prefix_routing": self.enabled}


def _charge(load: PeerLoad, n: int) -> None:
    """Count n jobs we handed a peer into our copy of its load: they take its free slots
    first (it starts them at once), then queue in its backlog."""
    take = min(load.free, n)
    load.free -= take
    load.backlog += n - take

