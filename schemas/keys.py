"""Every Redis key genpool touches is built here, and only here.

docs/protocol.md documents the same names for programs in other languages; change both together.
Stdlib only, so producers in any environment can import it.
"""
from __future__ import annotations

import re

PROTOCOL_VERSION = 1

# Lanes are separate streams rather than a priority field because a worker that is full must still
# be able to see interactive work (it reads `high` every step) without scanning past a bulk backlog.
LANES = ("high", "normal", "low")

# The consumer group every worker joins on every lane stream.
GROUP = "workers"

_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.\-:{}]{1,64}$")


def lane_for(priority: int) -> str:
    """priority < 0 -> high, 0 -> normal, > 0 -> low (lower value runs first, as in vLLM)."""
    if priority < 0:
        return "high"
    return "normal" if priority == 0 else "low"


class Keys:
    """Key names for one deployment prefix (default `genpool`)."""

    group = GROUP
    lanes = LANES

    def __init__(self, prefix: str = "genpool"):
        if not _PREFIX_RE.match(prefix or ""):
            raise ValueError(f"invalid key prefix {prefix!r}: use 1-64 of [A-Za-z0-9_.-:{{}}]")
        self.prefix = prefix

    def __repr__(self) -> str:
        return f"Keys({self.prefix!r})"

    def jobs(self, lane: str) -> str:
        """Lane stream; entries carry field `job` = JSON JobRequest."""
        if lane not in LANES:
            raise ValueError(f"unknown lane {lane!r}; lanes are {', '.join(LANES)}")
        return f"{self.prefix}:jobs:{lane}"

    def all_jobs(self) -> list[str]:
        return [self.jobs(lane) for lane in LANES]

    def lane_of_stream(self, stream: str) -> str:
        return stream.rsplit(":", 1)[-1]

    def job(self, job_id: str) -> str:
        """Job hash: state, attempts, worker, result/error JSON, timestamps."""
        return f"{self.prefix}:job:{job_id}"

    def events(self, job_id: str) -> str:
        """Per-job event stream; entries carry field `event` = JSON event."""
        return f"{self.prefix}:job:{job_id}:events"

    @property
    def control(self) -> str:
        """Broadcast stream of control messages (cancel) that every worker reads."""
        return f"{self.prefix}:control"

    @property
    def dead(self) -> str:
        """Dead-letter stream: entries that could not be run, with the reason."""
        return f"{self.prefix}:dead"

    @property
    def workers(self) -> str:
        """Hash: worker name -> JSON info (model, pid, host, started, last beat, load)."""
        return f"{self.prefix}:workers"

    def worker(self, name: str) -> str:
        """Heartbeat key with a TTL; its absence means the worker is gone."""
        return f"{self.prefix}:worker:{name}"
