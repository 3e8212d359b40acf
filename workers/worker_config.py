"""Settings of one worker (the `genpool worker` queue options)."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class WorkerConfig:
    name: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    served_models: frozenset = frozenset()
    claim_idle_ms: int = 30_000  # an entry idle this long belongs to a dead worker
    max_deliveries: int = 3  # a job delivered more often than this is dead-lettered
    drain_timeout_s: float = 30.0
    idle_block_ms: int = 200  # XREADGROUP BLOCK while the engine has nothing to do
    high_burst: int = 4  # high-lane jobs admitted beyond capacity (the engine preempts for them)
    heartbeat_s: float = 2.0
    max_inflight: Optional[int] = None  # default: the engine's max_num_seqs
    events_maxlen: int = 16384
    result_ttl_s: int = 86400
    job_ttl_s: int = 7 * 86400
