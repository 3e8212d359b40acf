"""API keys and tenants' limits as data in Redis (issue 31): `genpool keys`, the gateway's lookup.

A key's secret is shown once, at creation; Redis keeps its SHA-256 as the record's key name
(schemas/tenants.py), so anyone who reads Redis learns no usable key. A revoke deletes the
record: every gateway stops accepting the key when its cache entry (KEY_CACHE_S) runs out.
"""
from __future__ import annotations

import logging
import math
import secrets
import time
from typing import Optional

from genpool.schemas import Keys
from genpool.schemas.tenant_records import ApiKey, TenantLimits, read_limits
from genpool.schemas.tenants import (
    API_KEY_TTL_S,
    DEFAULT_TENANT,
    KEY_CACHE_S,
    TenantKeys,
    check_tenant,
    key_digest,
)

log = logging.getLogger("genpool.keys")
SECRET_PREFIX = "gp-"  # what a genpool key looks like (secret scanners can match it)
CACHE_MAX = 10_000  # cached lookups per gateway; past it the cache starts over


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


class KeyStore:
    """`genpool keys create|list|revoke` and tenants' limits, on a synchronous client."""

    def __init__(self, r, keys: Keys):
        self.r, self.t = r, TenantKeys(keys)

    def create(self, tenant: str, models: list[str], priority_ceiling: int, name: str = "",
               days: float = API_KEY_TTL_S / 86400) -> tuple[str, ApiKey]:
        """(the secret, shown once; its record). ValueError for the default tenant (whose jobs
        are every keyless and `--api-key` caller's: its key would see them all), a lifetime
        that is no positive number, or a priority ceiling out of range."""
        if tenant == DEFAULT_TENANT:
            raise ValueError(f"tenant {DEFAULT_TENANT!r} holds the jobs of every caller without "
                             f"a stored key: a key for it would see all of them; name a tenant")
        if not (isinstance(days, (int, float)) and math.isfinite(days) and days > 0):
            raise ValueError(f"days must be a positive number (got {days!r})")
        now, ttl = time.time(), max(1, int(days * 86400))
        key = ApiKey(id="key_" + secrets.token_hex(6), tenant=check_tenant(tenant),
                     models=list(models), priority_ceiling=priority_ceiling, name=name,
                     created=now, expires=now + ttl)
        secret = new_secret()
        digest = key_digest(secret)
        pipe = self.r.pipeline(transaction=True)  # record and index share {<prefix>}
        pipe.set(self.t.api_key(digest), key.model_dump_json(), ex=ttl)
        pipe.hset(self.t.api_keys, key.id, digest)
        pipe.execute()
        # the index lives as long as its longest key, and so do the tenant's limits and weight
        # (a key that outlived them would run unlimited)
        for name in (self.t.api_keys, self.t.limits(key.tenant), self.t.weights):
            self._keep_at_least(name, ttl)
        return secret, key

    def _keep_at_least(self, name: str, ttl: int) -> None:
        """Make `name` (when it exists) live at least `ttl` s more. EXPIRE's GT and NX options
        are Redis 7's; Sentinel and Cluster deployments here run 6.2. An admin command: a
        race between two of them leaves the longer TTL or the shorter, never none."""
        left = self.r.ttl(name)
        if left == -1 or 0 <= left < ttl:
            self.r.expire(name, ttl)

    def list(self) -> list[ApiKey]:
        index = self.r.hgetall(self.t.api_keys)
        ids = sorted(index)
        records = self.r.mget([self.t.api_key(index[i]) for i in ids]) if ids else []
        gone = [i for i, rec in zip(ids, records) if rec is None]  # expired keys
        if gone:
            self.r.hdel(self.t.api_keys, *gone)
        out = []
        for i, rec in zip(ids, records):
            try:
                if rec is not None:
                    out.append(ApiKey.model_validate_json(rec))
            except ValueError as e:  # someone else's write, or a record past today's bounds:
                # shown as missing, not a failure of every listing (and of set_limits)
                log.warning("key %s: its record is unreadable: %s", i, str(e).splitlines()[0])
        return out

    def revoke(self, key_id: str) -> bool:
        digest = self.r.hget(self.t.api_keys, key_id)
        if digest is None:
            return False
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(self.t.api_key(digest))
        pipe.hdel(self.t.api_keys, key_id)
        return bool(pipe.execute()[0])

    def set_limits(self, tenant: str, limits: TenantLimits) -> None:
        """Kept as long as the tenant's longest-lived key (a year at least)."""
        now = time.time()
        ttl = max([API_KEY_TTL_S] + [int(k.expires - now) + 1 for k in self.list()
                                     if k.tenant == tenant])
        pipe = self.r.pipeline(transaction=True)  # both in {<prefix>}
        pipe.set(self.t.limits(tenant), limits.model_dump_json(), ex=ttl)
        if limits.weight == 1:
            pipe.hdel(self.t.weights, tenant)
        else:
            pipe.hset(self.t.weights, tenant, limits.weight)
        pipe.execute()
        self._keep_at_least(self.t.weights, ttl)

    def limits(self, tenant: str) -> TenantLimits:
        raw = self.r.get(self.t.limits(tenant))
        return read_limits(raw)

    def find(self, secret: str) -> Optional[ApiKey]:
        raw = self.r.get(self.t.api_key(key_digest(secret)))
        return None if raw is None else ApiKey.model_validate_json(raw)


class KeyCache:
    """The gateway's lookups (asyncio client): a key, found or not, is trusted KEY_CACHE_S, so
    a revoke acts within that on every gateway, and a flood of bad keys costs Redis one GET per
    distinct key per KEY_CACHE_S. Entries are by digest: the cache holds no secret."""

    def __init__(self, r, keys: Keys, ttl_s: float = KEY_CACHE_S):
        self.r, self.t, self.ttl_s = r, TenantKeys(keys), ttl_s
        self.found: dict[str, tuple[float, Optional[ApiKey]]] = {}
        self.tenants: dict[str, tuple[float, TenantLimits]] = {}

    async def key(self, secret: str) -> Optional[ApiKey]:
        digest, now = key_digest(secret), time.monotonic()
        hit = self.found.get(digest)
        if hit is not None and hit[0] > now:
            return hit[1]
        raw = await self.r.get(self.t.api_key(digest))
        key = None if raw is None else ApiKey.model_validate_json(raw)
        self._put(self.found, digest, key, now)
        return key

    async def limits(self, tenant: str) -> TenantLimits:
        now = time.monotonic()
        hit = self.tenants.get(tenant)
        if hit is not None and hit[0] > now:
            return hit[1]
        raw = await self.r.get(self.t.limits(tenant))
        limits = read_limits(raw)
        self._put(self.tenants, tenant, limits, now)
        return limits

    def _put(self, cache: dict, name: str, value, now: float) -> None:
        if len(cache) >= CACHE_MAX:
            cache.clear()
        cache[name] = (now + self.ttl_s, value)
