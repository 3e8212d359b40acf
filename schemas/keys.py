"""Every Redis key genpool touches is built here, and only here.

docs/protocol.md documents the same names for programs in other languages; change both together.
Stdlib only, so producers in any environment can import it.
"""
from __future__ import annotations

import re
import zlib

PROTOCOL_VERSION = 1

# Lanes are separate streams rather than a priority field because a worker that is full must still
# be able to see interactive work (it reads `high` every step) without scanning past a bulk backlog.
LANES = ("high", "normal", "low")

# The consumer group every worker joins on every lane stream.
GROUP = "workers"

# Lane shards per priority (Keys.lane_shards); more than a cluster has nodes buys nothing.
MAX_LANE_SHARDS = 64

# No braces: the key layout puts the prefix inside hash tags (`{...}`), see Keys.
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.\-:]{1,64}$")
# A job id names two keys, so it may not contain ':' (it could spell another job's keys) nor
# braces (it could move them out of their shared hash tag). schemas/request.py has the same rule.
JOB_ID_CHARS = r"[A-Za-z0-9_.\-]{1,128}"
JOB_ID_RE = re.compile(f"^{JOB_ID_CHARS}$")


def check_job_id(job_id: str) -> str:
    if not (isinstance(job_id, str) and JOB_ID_RE.match(job_id)):
        raise ValueError(f"invalid job id {str(job_id)[:80]!r}: use 1-128 of [A-Za-z0-9_.-]")
    return job_id


def lane_for(priority: int) -> str:
    """priority < 0 -> high, 0 -> normal, > 0 -> low (lower value runs first, as in vLLM)."""
    if priority < 0:
        return "high"
    return "normal" if priority == 0 else "low"


def shard_for(job_id: str, shards: int) -> int:
    """The lane shard a job is enqueued on: CRC-32 (zlib/IEEE) of the UTF-8 id, modulo the
    shard count. Any shard is correct (workers read them all); this one spreads ids evenly."""
    return zlib.crc32(job_id.encode()) % shards if shards > 1 else 0


class Keys:
    """Key names for one deployment prefix (default `genpool`).

    Cluster-safe layout (docs/protocol.md, "Keys"): every key starts with `<prefix>:`, and the
    part in braces is its Redis Cluster hash tag, so keys that one script, MULTI or blocking read
    touches together hash to one slot:
      - a job's hash and event stream share `{<id>}` (one job = one slot; jobs spread out);
      - lane shard 0, the control and dead-letter streams and the worker registry share
        `{<prefix>}`; lane shard k > 0 has `{<prefix>:<k>}` (the three lanes of one shard always
        share a slot, so a worker reads one shard's lanes in one script).
    """

    group = GROUP
    lanes = LANES

    def __init__(self, prefix: str = "genpool", lane_shards: int = 1):
        if not _PREFIX_RE.match(prefix or ""):
            raise ValueError(f"invalid key prefix {prefix!r}: use 1-64 of [A-Za-z0-9_.-:]")
        if not 1 <= lane_shards <= MAX_LANE_SHARDS:
            raise ValueError(f"lane shards must be 1-{MAX_LANE_SHARDS}, got {lane_shards}")
        self.prefix, self.lane_shards = prefix, lane_shards
        self.tag = "{" + prefix + "}"

    def __repr__(self) -> str:
        return f"Keys({self.prefix!r}, lane_shards={self.lane_shards})"

    def with_shards(self, lane_shards: int) -> "Keys":
        return Keys(self.prefix, lane_shards)

    def shard_tag(self, shard: int) -> str:
        return self.tag if shard == 0 else "{" + f"{self.prefix}:{shard}" + "}"

    def jobs(self, lane: str, shard: int = 0) -> str:
        """Lane stream; entries carry field `job` = JSON JobRequest."""
        if lane not in LANES:
            raise ValueError(f"unknown lane {lane!r}; lanes are {', '.join(LANES)}")
        return f"{self.prefix}:jobs:{self.shard_tag(shard)}:{lane}"

    def shard_lanes(self, shard: int) -> list[str]:
        """high, normal, low of one shard (one hash slot)."""
        return [self.jobs(lane, shard) for lane in LANES]

    def all_jobs(self) -> list[str]:
        """Every lane stream of every shard, shard by shard."""
        return [k for shard in range(self.lane_shards) for k in self.shard_lanes(shard)]

    def submit_stream(self, job_id: str, lane: str) -> str:
        """Where a producer enqueues job `job_id` on `lane`."""
        return self.jobs(lane, shard_for(job_id, self.lane_shards))

    def lane_of_stream(self, stream: str) -> str:
        return stream.rsplit(":", 1)[-1]

    def job(self, job_id: str) -> str:
        """Job hash: state, attempts, worker, lease, result/error JSON, timestamps. `{id}` is a
        hash tag: the hash and its event stream live in one Redis Cluster slot, so one script
        can check the lease and write both."""
        return f"{self.prefix}:job:{{{check_job_id(job_id)}}}"

    def events(self, job_id: str) -> str:
        """Per-job event stream; entries carry field `event` = JSON event."""
        return f"{self.prefix}:job:{{{check_job_id(job_id)}}}:events"

    @property
    def control(self) -> str:
        """Broadcast stream of control messages (cancel) that every worker reads."""
        return f"{self.prefix}:control:{self.tag}"

    @property
    def dead(self) -> str:
        """Dead-letter stream: entries that could not be run, with the reason."""
        return f"{self.prefix}:dead:{self.tag}"

    @property
    def workers(self) -> str:
        """Hash: worker name -> JSON info (model, pid, host, started, last beat, load)."""
        return f"{self.prefix}:workers:{self.tag}"

    def worker(self, name: str) -> str:
        """Heartbeat key with a TTL; its absence means the worker is gone."""
        return f"{self.prefix}:worker:{self.tag}:{name}"

    @property
    def meta(self) -> str:
        """Hash of deployment settings workers publish: `lane_shards` (how many shards exist,
        so producers spread over exactly the shards workers read)."""
        return f"{self.prefix}:meta:{self.tag}"

    # -- prefix-aware routing (issue 21; workers/prefix_index.py). All in `{<prefix>}`, so one
    # lookup over every worker is one slot (one pipeline, cluster-safe).
    @property
    def route_workers(self) -> str:
        """Sorted set: worker name -> time (s) of its last prefix-index publish (fresh = live)."""
        return f"{self.prefix}:route:{self.tag}:workers"

    @property
    def route_load(self) -> str:
        """Hash: worker name -> JSON load summary (free slots, hand-off backlog, tokens per job,
        block size, model) published with its prefix index."""
        return f"{self.prefix}:route:{self.tag}:load"

    def prefix_index(self, name: str) -> str:
        """Set of the chain hashes (decimal) of the full KV blocks worker `name` caches (bounded,
        rewritten about every second, with a TTL)."""
        return f"{self.prefix}:route:{self.tag}:blocks:{name}"
