"""Tenants (issue 31): who a job is for, the Redis keys of API keys, quotas and usage.

A tenant's name appears inside Redis key names (rate counters, usage buckets), so it obeys the
job-id alphabet: no ':' (it could spell another key) and no braces (it could move a key out of
its hash tag). Every key here is in the prefix's control-plane slot `{<prefix>}` (or the job's
own `{<id>}`), so one script touches one Cluster slot. Stdlib only, like schemas/keys.py.
"""
from __future__ import annotations

import hashlib
import re

from .keys import JOB_TTL_S, Keys, field_text

DEFAULT_TENANT = "default"  # a job that names no tenant (and every `--api-key` key's jobs)
TENANT_CHARS = r"[A-Za-z0-9_.\-]{1,64}"
TENANT_RE = re.compile(f"^{TENANT_CHARS}$")

# Wire numbers (docs/protocol.md, "Tenants").
API_KEY_TTL_S = 365 * 86400  # a key's default lifetime; `genpool keys create --days` changes it
KEY_CACHE_S = 2.0  # a gateway trusts a looked-up key this long: a revoke acts within it (+ a hop)
RATE_WINDOW_S = 60  # requests / tokens per minute: fixed one-minute windows
USAGE_BUCKET_S = 3600  # usage is counted in hourly buckets ...
USAGE_TTL_S = 90 * 86400  # ... kept this long


# Fair pull (docs/protocol.md, "Tenants"): a non-default tenant's jobs queue on a sub-stream of
# their lane, `<lane stream>:t:<tenant>` (the lane's hash tag: one slot per shard), and workers
# take from a lane's backlogged tenants in deficit round robin, measured in estimated tokens.
SUB_STREAM_SEP = ":t:"
FAIR_QUANTUM = 2048  # tokens a tenant of weight 1 may take per turn
DEFAULT_COST = 256  # tokens charged for an entry that says nothing of its cost
FAIR_STATE_TTL_S = JOB_TTL_S  # a lane's ring, member sets and deficits, refreshed when used


def check_tenant(tenant: str) -> str:
    if not (isinstance(tenant, str) and TENANT_RE.match(tenant)):
        raise ValueError(f"invalid tenant {str(tenant)[:80]!r}: use 1-64 of [A-Za-z0-9_.-]")
    return tenant


def tenant_arg(text: str) -> str:
    """argparse type of a --tenant option (its message names the rule)."""
    import argparse

    try:
        return check_tenant(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def key_digest(secret: str) -> str:
    """What Redis stores of an API key: its SHA-256 (a key is random, 256 bits: no salt is
    needed, and the digest lets every gateway find it in one lookup)."""
    return hashlib.sha256(secret.encode()).hexdigest()


class TenantKeys:
    """Key names of the tenant features for one deployment prefix (all in `{<prefix>}`)."""

    def __init__(self, keys: Keys):
        self.prefix, self.tag = keys.prefix, keys.tag

    def api_key(self, digest: str) -> str:
        """String: the JSON ApiKey record of the key whose SHA-256 is `digest`; TTL = its life."""
        return f"{self.prefix}:apikey:{self.tag}:{digest}"

    @property
    def api_keys(self) -> str:
        """Hash: key id -> digest, for `genpool keys list|revoke` (TTL: the longest key's)."""
        return f"{self.prefix}:apikeys:{self.tag}"

    def limits(self, tenant: str) -> str:
        """String: the JSON TenantLimits of `tenant` (every key of the tenant shares them)."""
        return f"{self.prefix}:tenant:{self.tag}:{check_tenant(tenant)}:limits"

    @property
    def weights(self) -> str:
        """Hash: tenant -> its fair-pull weight, for the tenants whose weight is not 1 (workers
        read it every upkeep: they cannot know every tenant's limits record)."""
        return f"{self.prefix}:weights:{self.tag}"

    def running(self, tenant: str) -> str:
        """Sorted set: `<job id>@<worker>` -> slot deadline (ms) of `tenant`'s jobs holding a
        concurrency slot (SLOT_LUA; workers/caps.py)."""
        return f"{self.prefix}:running:{self.tag}:{check_tenant(tenant)}"

    def rate(self, tenant: str) -> str:
        """Hash: `window` (epoch seconds // RATE_WINDOW_S), `requests`, `tokens` of `tenant`
        in that window (RATE_LUA resets it when a new window begins; TTL two windows)."""
        return f"{self.prefix}:rate:{self.tag}:{check_tenant(tenant)}"

    def queued(self, tenant: str) -> str:
        """Sorted set: job id -> submit time of `tenant`'s jobs that may still be waiting, for
        its max_queued cap (producer/queued_cap.py prunes the ones that left the queue)."""
        return f"{self.prefix}:queued:{self.tag}:{check_tenant(tenant)}"

    def fair(self, lane_stream: str) -> list[str]:
        """The fair-pull state of one lane stream, in its slot: the ring (list of backlogged
        tenants, in turn order), the set of them, the set of every tenant that had a
        sub-stream here (reclaim looks at their pending entries), and the deficits (hash:
        tenant -> tokens of credit or debt; `:cursor`, `:resume`: whose turn is under way)."""
        return [f"{lane_stream}:fair:{what}" for what in ("ring", "active", "known", "deficit")]

    def storage_lock(self, tenant: str) -> str:
        """String: the token of the gateway that checks and writes an upload or a new batch of
        `tenant` (so its file and batch byte limits hold against concurrent requests on any
        gateway), with a PX TTL (BATCH_LEASE_LUA takes it, BATCH_RELEASE_LUA gives it back)."""
        return f"{self.prefix}:storage:{self.tag}:{check_tenant(tenant)}:lock"

    def usage(self, hour: int) -> str:
        """Hash of one USAGE_BUCKET_S bucket (hour = epoch seconds // USAGE_BUCKET_S):
        `<tenant>:prompt|completion|jobs` -> count. One key per hour, not per tenant, so
        `genpool usage` reads an hour in one HGETALL."""
        return f"{self.prefix}:usage:{self.tag}:{hour}"


def sub_stream(lane_stream: str, tenant: str) -> str:
    """Where a job of `tenant` (not the default one) queues on `lane_stream`."""
    return f"{lane_stream}{SUB_STREAM_SEP}{check_tenant(tenant)}"


def queue_known(pipe, keys: Keys) -> None:
    """Queue (sync or asyncio pipeline) what known_sub_streams reads: each lane's known set."""
    t = TenantKeys(keys)
    for lane in keys.all_jobs():
        pipe.smembers(t.fair(lane)[2])


def known_sub_streams(keys: Keys, replies: list) -> list[str]:
    """Every sub-stream a tenant ever had on a lane, from queue_known's replies (an unreadable
    reply, or a name that is no tenant's, is skipped)."""
    out = []
    for lane, members in zip(keys.all_jobs(), replies):
        if isinstance(members, (set, list)):
            out += [sub_stream(lane, field_text(m)) for m in sorted(members, key=field_text)
                    if TENANT_RE.match(field_text(m))]
    return out
