"""One connection factory for every genpool component: a URL in, a redis-py client out.

The URL alone says which topology it is (no extra flag to forget on one of the components):

    redis://[user:pass@]host:port/db   rediss://...   unix:///path.sock?db=0
        one server (redis-py's own from_url rules)
    redis+cluster://[user:pass@]host:port[,host:port...]        rediss+cluster://... (TLS)
        Redis Cluster (redis-py's RedisCluster); any reachable node is enough to discover the rest
    redis+sentinel://[user:pass@]host:port[,host:port...]/service_name[/db][?sentinel_password=...]
        the master Sentinel names `service_name` (redis-py's Sentinel.master_for); user:pass are
        the master's, sentinel_password the sentinels' own (if they require one)

Stdlib + redis only: producers must not need anything more.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence
from urllib.parse import parse_qs, unquote, urlsplit

import redis
from redis.cluster import ClusterNode, RedisCluster

from genpool.schemas.cluster import (  # ClusterUnreachable: what its cluster clients raise
    NO_NODE,
    ClusterUnreachable,  # noqa: F401
    as_lost_connection,
    lost_connection_when_unreachable,
)
from genpool.schemas.keys import LANES, MAX_LANE_SHARDS, field_int

# Errors that mean "Redis is away for now" (retry after a reconnect), as against an answer:
# a lost connection, a cluster whose slots are not served, a slot in the middle of a migration.
# (The clients connect() makes raise ClusterUnreachable, a ConnectionError, where redis-py 8.2+
# raises RedisClusterUnreachableError; it is here for clients made elsewhere.)
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterDownError,
              redis.exceptions.TryAgainError, *((NO_NODE,) if NO_NODE else ()))
CLUSTER_SCHEMES = {"redis+cluster": False, "rediss+cluster": True}
SENTINEL_SCHEMES = {"redis+sentinel": False}


@dataclass(frozen=True)
class Target:
    kind: str  # "single" | "cluster" | "sentinel"
    url: str
    nodes: tuple[tuple[str, int], ...] = ()
    service: Optional[str] = None
    db: int = 0
    username: Optional[str] = None
    password: Optional[str] = None
    tls: bool = False
    sentinel_password: Optional[str] = None

    def auth(self) -> dict:
        return {k: v for k, v in (("username", self.username), ("password", self.password)) if v}


def _nodes(netloc: str, url: str) -> tuple[tuple[str, int], ...]:
    hosts = netloc.rsplit("@", 1)[-1]
    out = []
    for part in hosts.split(","):
        host, _, port = part.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"bad host:port {part!r} in Redis URL {redact(url)!r}")
        out.append((host.strip("[]"), int(port)))
    return tuple(out)


def _userinfo(netloc: str) -> tuple[Optional[str], Optional[str]]:
    if "@" not in netloc:
        return None, None
    info = netloc.rsplit("@", 1)[0]
    user, _, password = info.partition(":")
    return unquote(user) or None, unquote(password) or None


def parse(url: str) -> Target:
    """What a URL names; raises ValueError with the accepted forms when it is malformed."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in CLUSTER_SCHEMES and scheme not in SENTINEL_SCHEMES:
        return Target("single", url)
    u = urlsplit(url)
    user, password = _userinfo(u.netloc)
    if scheme in CLUSTER_SCHEMES:
        if u.path.strip("/") not in ("", "0"):
            raise ValueError(f"Redis Cluster has only database 0: {redact(url)!r}")
        return Target("cluster", url, _nodes(u.netloc, url), username=user, password=password,
                      tls=CLUSTER_SCHEMES[scheme])
    parts = [p for p in u.path.split("/") if p]
    if not parts or len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise ValueError(f"a Sentinel URL is redis+sentinel://host:port[,host:port]/"
                         f"service_name[/db]; got {redact(url)!r}")
    query = parse_qs(u.query)
    return Target("sentinel", url, _nodes(u.netloc, url), service=unquote(parts[0]),
                  db=int(parts[1]) if len(parts) == 2 else 0, username=user, password=password,
                  sentinel_password=(query.get("sentinel_password") or [None])[0])


# Query parameters that carry a secret: redis-py's password= (unix:// URLs), ssl_password=,
# a Sentinel URL's sentinel_password=...
_SECRET_PARAM = re.compile(r"(?i)((?:^|[&;])[^=&;#]*(?:pass|secret|token)[^=&;#]*=)[^&;#]*")
_SCHEME = r"[A-Za-z][A-Za-z0-9+.-]*://"
# A URL inside free text: up to a blank or quote, or where the next URL starts (Celery joins
# a Sentinel broker's URLs with ';').
_URL_IN_TEXT = re.compile(_SCHEME + r".*?(?=[\s'\"<>`]|[;,]?" + _SCHEME + "|$)")


def redact(url: str) -> str:
    """`url` with its credentials replaced by *** (the user name stays): `user:password@`,
    `:password@`, a lone `token@`, and secret query parameters. The one form of a Redis URL
    (any form parse() takes) that may leave a process: errors, logs, metrics, status."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    # A password may hold a raw '@', '/', '?' or '#' (a URL parser would split it there, and the
    # connection fail, naming the URL): hide all up to the last '@', as a host list, /db and
    # /service/db never hold one; a unix:// socket path may, but it starts with '/', so its
    # credentials end at the first "@/".
    unix = scheme.lower() == "unix"
    at = (-1 if rest.startswith("/") else rest.find("@/")) if unix else rest.rfind("@")
    cred = ""
    if at >= 0:
        user, colon, _ = rest[:at].partition(":")
        cred, rest = (f"{user}:***@" if colon else "***@" if user else "@"), rest[at + 1:]
    rest, q, query = rest.partition("?")
    return f"{scheme}://{cred}{rest}{q}" + _SECRET_PARAM.sub(r"\1***", query)


def redact_text(text: str) -> str:
    """`text` (an error message, a log line) with every URL in it redact()ed."""
    return _URL_IN_TEXT.sub(lambda m: redact(m.group(0)), text)


mask = redact  # the earlier name


# A read on a healthy connection returns within its BLOCK (at most 5 s: producer/protocol.py
# READ_BLOCK_MS); only a dead one stays silent longer. redis-py 8 defaults to a 5 s socket
# timeout, which made every quiet 5 s XREAD BLOCK fail as if Redis were gone.
SOCKET_TIMEOUT_S = 30.0


def _timeouts(kwargs: dict) -> dict:
    """The data connections' options (the sentinels' own keep the caller's: a silent sentinel
    is skipped after redis-py's shorter default)."""
    return {"socket_timeout": SOCKET_TIMEOUT_S, **kwargs}


def connect(url: str, **kwargs: Any):
    """A sync client for `url`: redis.Redis, or RedisCluster. kwargs: redis-py connection
    options (decode_responses, socket_timeout, socket_connect_timeout, ...); socket_timeout
    defaults to SOCKET_TIMEOUT_S."""
    opts = _timeouts(kwargs)
    t = parse(url)
    if t.kind == "single":
        return redis.Redis.from_url(url, **opts)
    if t.kind == "cluster":
        with as_lost_connection():  # its first topology refresh runs here
            r = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in t.nodes],
                             ssl=t.tls, **t.auth(), **opts)
        return lost_connection_when_unreachable(r)
    from redis.sentinel import Sentinel

    sentinel = Sentinel(list(t.nodes), sentinel_kwargs=_sentinel_kwargs(t, kwargs), **opts)
    return sentinel.master_for(t.service, db=t.db, **t.auth())


def connect_async(url: str, max_connections: Optional[int] = None, **kwargs: Any):
    """The asyncio twin of connect(). With max_connections on one server the pool blocks for a
    free connection rather than failing (a gateway's streaming requests each hold one); in a
    cluster the cap is per node; behind Sentinel it is a hard cap (redis-py has no blocking
    Sentinel pool: past it, commands fail with MaxConnectionsError). Without it, redis-py's
    defaults apply (100 connections for one server or Sentinel)."""
    import redis.asyncio as aredis

    opts = _timeouts(kwargs)
    t = parse(url)
    if t.kind == "single":
        if max_connections is None:
            return aredis.Redis.from_url(url, **opts)
        pool = aredis.BlockingConnectionPool.from_url(url, max_connections=max_connections,
                                                      timeout=None, **opts)
        return aredis.Redis(connection_pool=pool)
    if t.kind == "cluster":
        from redis.asyncio.cluster import ClusterNode as AsyncNode
        from redis.asyncio.cluster import RedisCluster as AsyncCluster

        extra = {"max_connections": max_connections} if max_connections else {}
        r = AsyncCluster(startup_nodes=[AsyncNode(h, p) for h, p in t.nodes], ssl=t.tls,
                         **t.auth(), **extra, **opts)
        return lost_connection_when_unreachable(r, aio=True)
    from redis.asyncio.sentinel import Sentinel as AsyncSentinel

    sentinel = AsyncSentinel(list(t.nodes), sentinel_kwargs=_sentinel_kwargs(t, kwargs), **opts)
    extra = {"max_connections": max_connections} if max_connections else {}
    return sentinel.master_for(t.service, db=t.db, **t.auth(), **extra)


def _sentinel_kwargs(t: Target, kwargs: dict) -> dict:
    # Sentinels answer plain RESP without decoding or auth unless told; keep the timeouts.
    out = {k: v for k, v in kwargs.items() if k in ("socket_timeout", "socket_connect_timeout")}
    if t.sentinel_password:
        out["password"] = t.sentinel_password
    return out


def is_cluster(r) -> bool:
    """True for a (sync or asyncio) RedisCluster client or one of its pipelines: multi-key
    commands, MULTI and Lua must then stay within one hash slot."""
    from redis.asyncio.cluster import ClusterPipeline as AsyncClusterPipeline
    from redis.asyncio.cluster import RedisCluster as AsyncCluster
    from redis.cluster import ClusterPipeline

    return isinstance(r, (RedisCluster, ClusterPipeline, AsyncCluster, AsyncClusterPipeline))


def xread_one(r, key: str, last: str, count: int, block: int):
    """XREAD BLOCK of one stream (sync or asyncio client; await the result of the latter). In a
    cluster it goes straight to the key's node: XREAD's keys are 'movable', so redis-py would
    first ask a node COMMAND GETKEYS on every call (a second round trip), and its asyncio client
    races doing that from concurrent tasks on one connection."""
    if is_cluster(r):
        return r.execute_command("XREAD", "COUNT", count, "BLOCK", block, "STREAMS", key, last,
                                 target_nodes=r.get_node_from_key(key))
    return r.xread({key: last}, count=count, block=block)


def backoff(first: float = 0.05, cap: float = 2.0) -> Iterator[float]:
    """Retry delays for a Redis that stopped answering: doubling from `first` up to `cap`."""
    delay = first
    while True:
        yield delay
        delay = min(cap, delay * 2)


def queue_lane_depths(pipe, keys, sub_streams: Sequence[str] = ()) -> None:
    """Queue, on a sync or asyncio pipeline, what lane_depths() reads: XLEN and the group's
    XPENDING summary of every lane of every lane shard, then of each tenant's sub-stream given
    (schemas/tenants.py known_sub_streams)."""
    for stream in [*keys.all_jobs(), *sub_streams]:
        pipe.xlen(stream)
        pipe.xpending(stream, keys.group)


def lane_depths(replies: list, sub_lanes: Sequence[str] = ()) -> dict[str, tuple[int, int]]:
    """{lane: (queued, pending)} from queue_lane_depths()' replies (executed with
    raise_on_error=False: a lane or group not created yet counts as empty). Workers delete the
    entries they ack (docs/protocol.md), so a stream holds exactly its queued (never delivered)
    entries plus the pending ones. `sub_lanes`: the lane of each sub-stream queued after them."""
    out = {lane: (0, 0) for lane in LANES}
    lanes = len(replies) // 2 - len(sub_lanes)
    for i in range(len(replies) // 2):  # shard by shard, LANES order within a shard
        lane = LANES[i % len(LANES)] if i < lanes else sub_lanes[i - lanes]
        queued, pend = out[lane]
        length, summary = replies[2 * i], replies[2 * i + 1]
        pending = int(summary["pending"]) if isinstance(summary, dict) else 0
        length = length if isinstance(length, int) else 0
        out[lane] = (queued + max(0, length - pending), pend + pending)
    return out


def stored_shards(value) -> int:
    """The `lane_shards` field of the meta hash as workers published it (1 when unset, or when
    it is no count in range: someone else's write must not stop every producer)."""
    n = field_int(value)
    return n if n is not None and 1 <= n <= MAX_LANE_SHARDS else 1


def delete_prefix(r, prefix: str, batch: int = 500) -> int:
    """Delete every key under `<prefix>:` (sync client; on a cluster scan_iter visits every
    master and delete splits by slot). For throwaway prefixes (demo, tests, benchmarks); never
    a FLUSHDB, which would take other users' keys. Returns how many keys were deleted."""
    keys = list(r.scan_iter(match=f"{prefix}:*", count=1000))
    for i in range(0, len(keys), batch):
        r.delete(*keys[i:i + batch])
    return len(keys)
