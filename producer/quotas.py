"""Tenants' requests and tokens per minute (issue 31), for the gateway and Client(tenant=...).

One RATE_LUA call per request (schemas/tenant_scripts.py) counts it in its tenant's current
one-minute window or refuses it. Tokens are counted when the request comes in, as OpenAI does:
an estimate of the prompt (4 characters a token: the gateway holds no tokenizer) plus what it
may generate (max_tokens for each of its n completions).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

from genpool.schemas import Keys
from genpool.schemas.request import JobRequest
from genpool.schemas.scripting import Script
from genpool.schemas.tenant_records import TenantLimits, read_limits
from genpool.schemas.tenant_scripts import RATE_LUA
from genpool.schemas.tenants import DEFAULT_TENANT, KEY_CACHE_S, RATE_WINDOW_S, TenantKeys

from .queued_cap import QueuedCap

RATE = Script(RATE_LUA)
CHARS_PER_TOKEN = 4
_WHAT = {"requests": "requests per minute", "tokens": "tokens per minute"}


def estimate_tokens(req: JobRequest) -> int:
    """What a request counts against its tokens per minute."""
    chars = len(req.prompt or "") + sum(len(m.content) for m in req.messages or [])
    ids = len(req.prompt_token_ids or [])  # a token-id prompt counts what it is
    return math.ceil(chars / CHARS_PER_TOKEN) + ids + req.max_tokens * req.n


@dataclass(frozen=True)
class RateVerdict:
    """One RATE_LUA answer, with the limits it was judged against."""

    verdict: str  # ok | requests | tokens
    requests: int
    tokens: int
    reset_ms: int
    limits: TenantLimits
    tenant: str
    cost: int

    @property
    def ok(self) -> bool:
        return self.verdict == "ok"

    @property
    def never(self) -> bool:
        """Refused for counting more tokens than a whole minute allows: no retry fits it."""
        return self.verdict == "tokens" and self.limits.tpm is not None and \
            self.cost > self.limits.tpm

    def headers(self) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers (only for the limits the tenant has), plus
        Retry-After (whole seconds, rounded up) on a refusal."""
        reset = f"{self.reset_ms / 1000:.3f}s"
        out: dict[str, str] = {}
        for what, limit, used in (("requests", self.limits.rpm, self.requests),
                                  ("tokens", self.limits.tpm, self.tokens)):
            if limit is not None:
                out[f"x-ratelimit-limit-{what}"] = str(limit)
                out[f"x-ratelimit-remaining-{what}"] = str(max(0, limit - used))
                out[f"x-ratelimit-reset-{what}"] = reset
        if not self.ok and not self.never:
            out["retry-after"] = str(max(1, math.ceil(self.reset_ms / 1000)))
        return out

    def message(self) -> str:
        if self.never:
            return (f"this request counts {self.cost} tokens (prompt estimate + max_tokens x n), "
                    f"more than tenant {self.tenant!r}'s limit of {self.limits.tpm} tokens per "
                    f"minute: no retry admits it; lower max_tokens or shorten the prompt")
        limit = self.limits.rpm if self.verdict == "requests" else self.limits.tpm
        need = "" if self.verdict == "requests" else f"; this request counts {self.cost} tokens"
        return (f"tenant {self.tenant!r} is over its limit of {limit} {_WHAT[self.verdict]} "
                f"({self.requests if self.verdict == 'requests' else self.tokens} used in this "
                f"minute{need}); retry in {self.reset_ms / 1000:.1f} s")


class RateLimited(Exception):
    """A tenant's request was refused by its requests- or tokens-per-minute limit: `limit`
    says which ("requests" | "tokens"), `retry_after_s` when the window turns."""

    def __init__(self, verdict: RateVerdict):
        super().__init__(verdict.message())
        self.verdict, self.limit = verdict, verdict.verdict
        self.retry_after_s = verdict.reset_ms / 1000


def _rate_call(keys: Keys, tenant: str, limits: TenantLimits, cost: int) -> tuple[list, list]:
    return ([TenantKeys(keys).rate(tenant)],
            [limits.rpm or 0, limits.tpm or 0, cost, RATE_WINDOW_S])


def _verdict(reply, limits: TenantLimits, tenant: str, cost: int) -> RateVerdict:
    verdict, requests, tokens, reset = reply
    verdict = verdict.decode() if isinstance(verdict, bytes) else verdict
    return RateVerdict(verdict, int(requests), int(tokens), int(reset), limits, tenant, cost)


def charge(r, keys: Keys, req: JobRequest, limits: TenantLimits) -> RateVerdict:
    """Count `req` against its tenant's limits (a synchronous client); RateLimited when over."""
    cost = estimate_tokens(req)
    v = _verdict(RATE(r, *_rate_call(keys, req.tenant, limits, cost)), limits, req.tenant, cost)
    if not v.ok:
        raise RateLimited(v)
    return v


async def acharge_cost(r, keys: Keys, tenant: str, cost: int,
                       limits: TenantLimits) -> RateVerdict:
    """charge() on an asyncio client, for a request estimated at `cost` tokens."""
    reply = await RATE.acall(r, *_rate_call(keys, tenant, limits, cost))
    v = _verdict(reply, limits, tenant, cost)
    if not v.ok:
        raise RateLimited(v)
    return v


class ProducerQuota:
    """What Client / AsyncClient check before submitting a job of a named tenant (the default
    tenant's producers hold the Redis URL and are not limited here; the gateway limits every
    tenant). The tenant's limits are read at most once per KEY_CACHE_S."""

    def __init__(self, keys: Keys, enabled: bool = True):
        self.keys, self.t, self.enabled = keys, TenantKeys(keys), enabled
        self.queued = QueuedCap(keys)
        self.cached: dict[str, tuple[float, TenantLimits]] = {}

    def _hit(self, tenant: str):
        hit = self.cached.get(tenant)
        return hit[1] if hit is not None and hit[0] > time.monotonic() else None

    def _keep(self, tenant: str, raw) -> TenantLimits:
        limits = read_limits(raw)
        if len(self.cached) > 1000:
            self.cached.clear()
        self.cached[tenant] = (time.monotonic() + KEY_CACHE_S, limits)
        return limits

    def check(self, r, req: JobRequest) -> None:
        if req.tenant == DEFAULT_TENANT or not self.enabled:
            return
        limits = self._hit(req.tenant) or self._keep(req.tenant, r.get(self.t.limits(req.tenant)))
        if limits.charged and r.exists(self.keys.job(req.id)):
            return  # a resubmit of an existing id is a no-op (the submit skips it): no charge
        if limits.rated:
            charge(r, self.keys, req, limits)
        if limits.max_queued is not None:  # QueueCapReached (a refused job was counted above)
            self.queued.enter(r, req.tenant, req.id, limits.max_queued)

    async def acheck(self, r, req: JobRequest) -> None:
        if req.tenant == DEFAULT_TENANT or not self.enabled:
            return
        limits = self._hit(req.tenant) or self._keep(
            req.tenant, await r.get(self.t.limits(req.tenant)))
        if limits.charged and await r.exists(self.keys.job(req.id)):
            return  # as in check()
        if limits.rated:
            await acharge_cost(r, self.keys, req.tenant, estimate_tokens(req), limits)
        if limits.max_queued is not None:
            await self.queued.aenter(r, req.tenant, req.id, limits.max_queued)
