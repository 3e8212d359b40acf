"""Settings of one worker (the `genpool worker` queue options, derived from these fields' metadata)."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Optional

from genpool.schemas.keys import EVENTS_MAXLEN, JOB_TTL_S, RESULT_TTL_S


def _opt(help: str, **extra) -> dict:
    return {"help": help, **extra}


@dataclass
class WorkerConfig:
    name: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}",
                      metadata=_opt("consumer name (default host-pid)"))
    served_models: frozenset[str] = field(default=frozenset(), metadata=_opt(
        "name(s) jobs may ask for (default: --model and the checkpoint dir name)",
        aliases=("--served-model-name",)))
    model_name: str = field(default="", metadata=_opt(
        "the primary served name (metrics label, /v1/models id; default: the first of --served-model-name "
        "or the model's registry name)"))
    claim_idle_ms: int = field(default=30_000, metadata=_opt(
        "reclaim entries another worker has held this long without progress (a dead worker's)"))
    max_deliveries: int = field(default=3, metadata=_opt("dead-letter a job delivered more often than this"))
    drain_timeout_s: float = field(default=30.0, metadata=_opt(
        "seconds to finish in-flight jobs after SIGTERM", aliases=("--drain-timeout",)))
    resume: bool = field(default=True, metadata=_opt(
        "resume a job taken over from a lost or drained worker after the tokens it published "
        "(off: rerun it from the start, its `restart` event saying so)"))
    idle_block_ms: int = field(default=200, metadata=_opt("XREADGROUP BLOCK while the engine has nothing to do"))
    high_burst: int = field(default=4, metadata=_opt(
        "interactive jobs admitted beyond capacity (the engine preempts for them)"))
    heartbeat_s: float = field(default=2.0, metadata=_opt("seconds between heartbeats"))
    max_inflight: Optional[int] = field(default=None, metadata=_opt(
        "jobs held at once (default: the engine's max_num_seqs)"))
    events_maxlen: int = field(default=EVENTS_MAXLEN, metadata=_opt("approximate length cap of a job's event stream"))
    result_ttl_s: int = field(default=RESULT_TTL_S, metadata=_opt("seconds results are kept", aliases=("--result-ttl",)))
    job_ttl_s: int = field(default=JOB_TTL_S, metadata=_opt("seconds a job's record is kept"))
    lane_shards: int = field(default=1, metadata=_opt(
        "lane streams per priority, each in its own Redis Cluster hash slot, so intake spreads over "
        "nodes; workers read every shard, and the count recorded in Redis only ever grows "
        "(docs/operations.md)"))
    prefix_routing: bool = field(default=True, metadata=_opt(
        "prefix-aware routing: publish this worker's cached KV blocks, and hand a newly pulled job "
        "to the live peer that caches more of its prompt when that is cheaper (docs/design.md)"))
    prefix_index_s: float = field(default=1.0, metadata=_opt(
        "seconds between prefix-index publishes (a peer's index older than 3x this or 3 "
        "heartbeats, and at least 3 s, is ignored)"))
    route_min_gain_tokens: int = field(default=64, metadata=_opt(
        "prompt tokens a hand-off must save (its expected cost, queue included) to move a job"))
