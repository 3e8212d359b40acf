"""The gateway's side of tenants (issue 31): who is calling, what its key allows, its quotas.

`Tenancy.principal` turns an Authorization header into a Principal: a `--api-key` key (tenant
"default", no limits) or a key stored in Redis (producer/keys_store.py). `Tenancy.admit` applies
the key's models and priority ceiling, stamps the tenant on the job and counts the request
against the tenant's requests and tokens per minute (producer/quotas.py), answering 429 with
Retry-After and OpenAI's x-ratelimit-* headers when over. No message here holds a secret.
"""
from __future__ import annotations

import hmac
import math
from dataclasses import dataclass
from typing import Any, Optional

from genpool.schemas import Keys
from genpool.schemas.keys import field_int
from genpool.schemas.tenant_records import ApiKey, TenantLimits
from genpool.schemas.tenants import DEFAULT_TENANT, RATE_WINDOW_S, TenantKeys

from .keys_store import KeyCache
from .openai_format import APIError, OpenAIRequest
from .queued_cap import QueueCapReached, QueuedCap
from .quotas import CHARS_PER_TOKEN, RateLimited, RateVerdict, acharge_cost


@dataclass(frozen=True)
class Principal:
    """Who sent a request: its tenant, and its stored key (None: a `--api-key` key or no auth)."""

    tenant: str = DEFAULT_TENANT
    key: Optional[ApiKey] = None


def estimate_cost(kwargs: dict[str, Any]) -> int:
    """producer/quotas.estimate_tokens for a parsed OpenAI request's submit arguments."""
    text = kwargs.get("prompt") or ""
    chars = len(text) + sum(len(m["content"]) for m in kwargs.get("messages") or [])
    ids = len(kwargs.get("prompt_token_ids") or [])  # a token-id prompt counts what it is
    return math.ceil(chars / CHARS_PER_TOKEN) + ids + kwargs["max_tokens"] * kwargs.get("n", 1)


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key")


class Tenancy:
    def __init__(self, keys: Keys, static_keys: list[bytes], stored_keys: bool):
        self.keys, self.static, self.stored = keys, static_keys, stored_keys
        self.cache: Optional[KeyCache] = None
        self.queued = QueuedCap(keys)

    @property
    def checks_keys(self) -> bool:
        return bool(self.static) or self.stored

    def start(self, r) -> None:
        self.cache = KeyCache(r, self.keys)

    async def principal(self, authorization: str) -> Principal:
        if not self.checks_keys:
            return Principal()
        if not authorization.lower().startswith("bearer ") or not authorization[7:].strip():
            raise _unauthorized("You didn't provide an API key. Send it in the Authorization "
                                "header as 'Bearer KEY'.")
        given = authorization[7:].strip()
        if any(hmac.compare_digest(given.encode(), k) for k in self.static):
            return Principal()
        key = await self.cache.key(given) if self.stored and self.cache is not None else None
        if key is None:
            raise _unauthorized("Incorrect API key provided.")
        return Principal(key.tenant, key)

    async def precheck(self, principal: Principal, r) -> None:
        """429 before the body is read or parsed (a grammar check can take a second) when the
        tenant has used its requests this minute. A read, never a charge: admit() charges. The
        window is judged on the server's clock (TIME, asked only when the count is at the
        limit), as RATE_LUA judges it: a gateway's skewed clock refuses nothing it would take."""
        if principal.key is None or self.cache is None:
            return
        limits = await self.cache.limits(principal.tenant)
        if limits.rpm is None:
            return
        window, used, tokens = await r.hmget(TenantKeys(self.keys).rate(principal.tenant),
                                             "window", "requests", "tokens")
        used = field_int(used) or 0
        if used < limits.rpm:
            return  # the common case: one round trip
        secs, micros = await r.time()  # (a keyless command: any node of a Cluster answers)
        now = secs + micros / 1e6
        if field_int(window) == int(now // RATE_WINDOW_S):
            v = RateVerdict("requests", used, field_int(tokens) or 0,
                            int((RATE_WINDOW_S - now % RATE_WINDOW_S) * 1000), limits,
                            principal.tenant, 0)
            raise APIError(429, v.message(), type_="rate_limit_exceeded",
                           code="rate_limit_requests", headers=v.headers())

    async def admit(self, principal: Principal, req: OpenAIRequest, asked_priority: bool,
                    r) -> dict[str, str]:
        """Apply the key's rules to `req` and charge its quota; the headers to answer with."""
        key, kw = principal.key, req.kwargs
        kw["tenant"] = principal.tenant
        if key is None:
            return {}
        model = kw.get("model") or req.model  # a model-less request: the pool's one model
        if not key.allows_model(model):
            raise APIError(404, f"The model '{model}' does not "
                                f"exist or this key may not use it", param="model",
                           code="model_not_found")
        if kw["priority"] < key.priority_ceiling:
            if asked_priority:
                raise APIError(400, f"priority {kw['priority']} is above what this key allows "
                                    f"(lowest value {key.priority_ceiling})", param="priority",
                               code="invalid_value")
            kw["priority"] = key.priority_ceiling  # the gateway's default, lowered to the key's
        limits = await self.cache.limits(principal.tenant)
        headers = await self._charge(principal.tenant, kw, limits, r) if limits.rated else {}
        if limits.max_queued is not None:
            try:
                await self.queued.aenter(r, principal.tenant, kw["job_id"], limits.max_queued)
            except QueueCapReached as e:
                raise APIError(429, str(e), type_="rate_limit_exceeded",
                               code="tenant_queue_full", headers=headers) from None
        return headers

    async def _charge(self, tenant: str, kw: dict[str, Any], limits: TenantLimits,
                      r) -> dict[str, str]:
        try:
            verdict = await acharge_cost(r, self.keys, tenant, estimate_cost(kw), limits)
        except RateLimited as e:
            raise APIError(429, str(e), type_="rate_limit_exceeded",
                           code=f"rate_limit_{e.limit}", headers=e.verdict.headers()) from None
        return verdict.headers()
