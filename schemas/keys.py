"""Every Redis key genpool touches is built here, and only here.

docs/protocol.md documents the same names for programs in other languages; change both together.
Stdlib only, so producers in any environment can import it.
"""
from __future__ import annotations

import asyncio
import inspect
import math
import re
import zlib

PROTOCOL_VERSION = 1

# Lanes are separate streams rather than a priority field because a worker that is full must still
# be able to see interactive work (it reads `high` every step) without scanning past a bulk backlog.
LANES = ("high", "normal", "low")

# The consumer group every worker joins on every lane stream.
GROUP = "workers"

# A job hash's `state` (docs/protocol.md, "The job hash"): queued or running while its entry is in
# a lane, then one of the finished states, written by the worker that ends it.
JOB_STATES = ("queued", "running", "done", "error", "cancelled", "expired", "dead")
FINISHED_STATES = JOB_STATES[2:]

# Wire numbers: how long each key lives and how far each stream grows (docs/protocol.md, "Keys").
JOB_TTL_S = 7 * 86400  # a queued job's hash lives this long; workers shorten it once done
RESULT_TTL_S = 86400  # a finished job's hash and event stream are kept this long
EVENTS_MAXLEN = 16384  # a job's event stream, approximately (older events are trimmed)
CONTROL_MAXLEN = 10_000  # the broadcast control stream (cancels)
DEAD_MAXLEN = 100_000  # the dead-letter stream
META_TTL_S = 30 * 86400  # the deployment's meta hash (lane shards), refreshed by every worker start
# A released entry's idle time (ms), set as it is handed back (XCLAIM ... IDLE): longer than any
# claim window, so the next reclaim check of any peer takes it instead of waiting claim_idle_ms.
RELEASED_IDLE_MS = 365 * 86400 * 1000
WORKER_STALE_S = 3600  # a worker whose last beat is this old is dropped from the workers hash


def heartbeat_ttl_s(interval_s: float) -> int:
    """A worker's liveness key outlives two missed beats."""
    return max(5, int(3 * interval_s + 1))


# Lane shards per priority (Keys.lane_shards); more than a cluster has nodes buys nothing.
MAX_LANE_SHARDS = 64

# No braces: the key layout puts the prefix inside hash tags (`{...}`), see Keys.
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.\-:]{1,64}$")
# A job id names two keys, so it may not contain ':' (it could spell another job's keys) nor
# braces (it could move them out of their shared hash tag). schemas/request.py has the same rule.
JOB_ID_CHARS = r"[A-Za-z0-9_.\-]{1,128}"
JOB_ID_RE = re.compile(f"^{JOB_ID_CHARS}$")
# a lane stream's name ends in its lane, a tenant's sub-stream's in `<lane>:t:<tenant>`
_LANE_TAIL = re.compile(r":(high|normal|low)(?::t:[A-Za-z0-9_.\-]{1,64})?$")


def check_job_id(job_id: str) -> str:
    if not (isinstance(job_id, str) and JOB_ID_RE.match(job_id)):
        raise ValueError(f"invalid job id {str(job_id)[:80]!r}: use 1-128 of [A-Za-z0-9_.-]")
    return job_id


def hash_tag(key: str) -> str:
    """What Redis Cluster hashes of `key`: the text between its first `{` and the next `}`
    when that is not empty, else the whole key. Keys with equal tags share a slot."""
    start = key.find("{")
    end = key.find("}", start + 1) if start >= 0 else -1
    return key[start + 1:end] if end > start + 1 else key


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
        """The lane of a lane stream, or of a tenant's sub-stream of one (schemas/tenants.py)."""
        m = _LANE_TAIL.search(stream)
        return m.group(1) if m else stream.rsplit(":", 1)[-1]

    def job(self, job_id: str) -> str:
        """Job hash: state, attempts, worker, lease, result/error JSON, timestamps. `{id}` is a
        hash tag: the hash and its event stream live in one Redis Cluster slot, so one script
        can check the lease and write both."""
        return f"{self.prefix}:job:{{{check_job_id(job_id)}}}"

    @property
    def job_pattern(self) -> str:
        """SCAN MATCH pattern of every job hash (not their event streams: those end in
        `:events`); braces are literal in Redis patterns, and job ids hold none."""
        return f"{self.prefix}:job:{{*}}"

    def job_id_of(self, key: str) -> str:
        """The job id in a job hash's key (the inverse of `job`)."""
        return key[len(self.prefix) + len(":job:{"):-1]

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
        """Hash: worker name -> JSON info (model, pid, host, started, last beat, load); TTL
        WORKER_STALE_S from the newest beat."""
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

    # -- the OpenAI Files and Batch API (issue 32; schemas/batches.py, schemas/batch_scripts.py).
    # A file's keys share `{<file id>}`, a batch's `{<batch id>}` (ids use the job-id alphabet);
    # the listings are in `{<prefix>}`.
    def file(self, file_id: str) -> str:
        """Hash: `record` (JSON FileRecord) and `content` (the file's text), with a TTL; once
        deleted, `deleted` (unix time) alone for DELETED_CURSOR_S (a listing's cursor)."""
        return f"{self.prefix}:file:{{{check_job_id(file_id)}}}"

    @property
    def files(self) -> str:
        """Sorted set: file id -> created_at (the listing; ids whose file expired are pruned)."""
        return f"{self.prefix}:files:{self.tag}"

    def batch(self, batch_id: str) -> str:
        """Hash: `record` (JSON BatchRecord) and the mutable fields (status, stamps, counts)."""
        return f"{self.prefix}:batch:{{{check_job_id(batch_id)}}}"

    def batch_lines(self, batch_id: str) -> str:
        """Hash: job id -> JSON {n: line number, obj: the input line, lead: the job id of the
        first line of its prompt prefix} of each valid line not yet answered."""
        return f"{self.prefix}:batch:{{{check_job_id(batch_id)}}}:lines"

    def batch_todo(self, batch_id: str) -> str:
        """Sorted set: job id -> order, of the lines not yet submitted (producer/batch_feed.py:
        each prompt prefix's first line first, then the rest prefix by prefix)."""
        return f"{self.prefix}:batch:{{{check_job_id(batch_id)}}}:todo"

    def batch_sent(self, batch_id: str) -> str:
        """Set: job ids of the lines submitted and not yet answered."""
        return f"{self.prefix}:batch:{{{check_job_id(batch_id)}}}:sent"

    def batch_done(self, batch_id: str) -> str:
        """Hash: custom_id -> JSON output or error line: each custom_id answered once (HSETNX)."""
        return f"{self.prefix}:batch:{{{check_job_id(batch_id)}}}:done"

    def batch_lease(self, batch_id: str) -> str:
        """String: the token of the gateway that drives the batch, with a PX TTL."""
        return f"{self.prefix}:batch:{{{check_job_id(batch_id)}}}:lease"

    @property
    def batches(self) -> str:
        """Sorted set: batch id -> created_at (the listing)."""
        return f"{self.prefix}:batches:{self.tag}"

    @property
    def batches_active(self) -> str:
        """Sorted set: batch id -> expires_at of every batch not yet ended (what drivers scan)."""
        return f"{self.prefix}:batches:{self.tag}:active"

    def batch_webhook(self, batch_id: str) -> str:
        """Hash: the delivery of the batch's end event: state (pending, delivered, dead), tries,
        until (ms: a sender's claim), holder."""
        return f"{self.prefix}:batch:{{{check_job_id(batch_id)}}}:webhook"

    @property
    def webhooks_due(self) -> str:
        """Sorted set: batch id -> when (s) its end event is to be sent (again)."""
        return f"{self.prefix}:webhooks:{self.tag}:due"

    @property
    def webhooks_dead(self) -> str:
        """Sorted set: batch id -> when its end event was given up on (dead-lettered)."""
        return f"{self.prefix}:webhooks:{self.tag}:dead"


# -- what these keys need from the server --------------------------------------------------------
# Lane streams hold the queued jobs, job hashes each job's state and lease; those hashes and the
# event streams carry TTLs. So any maxmemory-policy but noeviction loses jobs silently: allkeys-*
# evict any key, volatile-* the ones with a TTL (under allkeys-lru, 56 of 300 jobs never ended).
# Under noeviction a full Redis refuses new jobs and keeps every queued one.
SAFE_MEMORY_POLICY = "noeviction"
_said: set[tuple[str, str]] = set()  # (logger, message): each said once per process


def check_memory_policy(r, log):
    """Warn loudly (log.error) when the server evicts keys; when its policy cannot be read
    (CONFIG disabled or renamed, as on managed Redis), say so once and go on. On a Redis
    Cluster every master is asked; behind Sentinel, the master. Never raises, and stays
    silent on a lost connection (the caller's own commands fail and it reconnects, then this
    runs again). With an asyncio client it returns an awaitable, to await."""
    if inspect.iscoroutinefunction(getattr(r, "execute_command", None)):
        return _check_async(r, log)
    try:
        targets = {"target_nodes": r.get_primaries()} if hasattr(r, "get_primaries") else {}
        reply = r.config_get("maxmemory-policy", **targets)
    except Exception as e:  # noqa: BLE001 - a check must never stop a start
        return _unreadable(r, e, log)
    _judge(r, reply, log)
    return None


async def _check_async(r, log, timeout_s: float = 5.0) -> None:
    async def ask():
        if hasattr(r, "get_primaries"):  # an asyncio cluster knows its nodes once initialized
            await r.initialize()
            return await r.config_get("maxmemory-policy", target_nodes=r.get_primaries())
        return await r.config_get("maxmemory-policy")
    try:  # bounded: a server that does not answer must not hold up the caller's start
        reply = await asyncio.wait_for(ask(), timeout_s)
    except Exception as e:  # noqa: BLE001 - a check must never stop a start
        return _unreadable(r, e, log)
    _judge(r, reply, log)


def field_int(v) -> "int | None":
    """A non-negative integer read from a Redis field (bytes or str) another process wrote, or
    None when it is not one in ASCII digits: `"²".isdigit()` is True and int() then raises."""
    if isinstance(v, bytes):
        v = v.decode("ascii", "replace")
    return int(v) if isinstance(v, str) and v.isascii() and v.isdigit() else None


def field_float(v) -> "float | None":
    """A finite number read from a Redis field another process wrote, else None ("nan", "inf"
    and junk: a time of NaN prints as invalid JSON, one of inf overflows a date)."""
    try:
        x = float(v.decode("ascii", "replace") if isinstance(v, bytes) else v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def field_text(v) -> str:
    """Text read from Redis that another process wrote: bytes decoded leniently (never a
    UnicodeDecodeError), anything else as str()."""
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def _policies(r, reply) -> dict[str, str]:
    """{server: policy} from CONFIG GET's reply: one server's {name: value}, or a cluster's
    {node: {name: value}} (redis-py gives the bare reply when one node answered)."""
    if any(field_text(k) == "maxmemory-policy" for k in reply):
        return {_where(r): next(field_text(v) for k, v in reply.items()
                                if field_text(k) == "maxmemory-policy")}
    return {field_text(node): field_text(next(iter(d.values()), "")) for node, d in reply.items()}


def _judge(r, reply, log) -> None:
    for where, policy in sorted(_policies(r, reply).items()):
        if policy != SAFE_MEMORY_POLICY:
            _say(log, log.error, f"Redis at {where} has maxmemory-policy {policy}: when memory "
                 f"runs out it evicts keys, and genpool then loses queued jobs, leases and "
                 f"results without a trace. Set maxmemory-policy {SAFE_MEMORY_POLICY} (a full "
                 f"Redis then refuses new jobs and keeps every queued one).")


def _unreadable(r, e: Exception, log) -> None:
    if any(c.__name__ in ("ConnectionError", "TimeoutError") for c in type(e).__mro__):
        return
    _say(log, log.warning, f"could not read maxmemory-policy of {_where(r)} "
         f"({type(e).__name__}: {e}); genpool needs {SAFE_MEMORY_POLICY} (any other policy "
         f"loses jobs) and cannot check it here; going on")


def _say(log, level, message: str) -> None:
    if (log.name, message) not in _said:
        _said.add((log.name, message))
        level(message)


def _where(r) -> str:
    pool = getattr(r, "connection_pool", None)
    kw = getattr(pool, "connection_kwargs", None) or {}
    if "host" in kw:
        return f"{kw['host']}:{kw.get('port', 6379)}"
    if "path" in kw:
        return str(kw["path"])
    service = getattr(pool, "service_name", None)
    return f"the master of {service}" if service else "the Redis server"
