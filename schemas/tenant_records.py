"""What Redis holds of API keys and tenants' limits (issue 31): JSON records, strictly typed.

The key names are in schemas/tenants.py. An API key's secret is never stored, only its SHA-256
(the record's Redis key); a record never holds the secret, so printing one leaks nothing.
"""
from __future__ import annotations

import json
import logging
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field

from .request import CALLER_PRIORITY_CEILING
from .tenants import DEFAULT_TENANT, TENANT_CHARS

log = logging.getLogger("genpool.tenants")

KEY_ID_CHARS = r"key_[0-9a-f]{12}"
Limit = Optional[int]  # None: no limit


class ApiKey(BaseModel):
    """One API key (`genpool keys create`): whose it is and what it may do."""

    model_config = ConfigDict(strict=True, extra="forbid")
    id: str = Field(pattern=f"^{KEY_ID_CHARS}$")  # names the key in `keys list|revoke`, logs
    tenant: str = Field(default=DEFAULT_TENANT, pattern=f"^{TENANT_CHARS}$")
    models: list[str] = Field(default_factory=list, max_length=64)  # empty: any model
    # the most urgent priority its requests may ask for (lower runs sooner; lanes: keys.lane_for)
    priority_ceiling: int = Field(default=CALLER_PRIORITY_CEILING, ge=-(2**31), lt=2**31)
    name: str = Field(default="", max_length=200)  # a note for people: who holds it
    created: float = 0.0
    expires: float = 0.0

    def allows_model(self, model: Optional[str]) -> bool:
        return not self.models or model in self.models


class TenantLimits(BaseModel):
    """A tenant's quotas, shared by all its keys and by `Client(tenant=...)` producers."""

    model_config = ConfigDict(strict=True, extra="forbid")
    rpm: Limit = Field(default=None, ge=1)  # requests per minute
    tpm: Limit = Field(default=None, ge=1)  # tokens per minute (prompt estimate + max_tokens)
    max_concurrent: Limit = Field(default=None, ge=1)  # jobs running at once, pool-wide
    max_queued: Limit = Field(default=None, ge=1)  # jobs waiting at once
    weight: int = Field(default=1, ge=1, le=1000)  # its share in fair pull

    @property
    def rated(self) -> bool:
        return self.rpm is not None or self.tpm is not None

    @property
    def charged(self) -> bool:
        """A producer's submit counts against these limits (a rate or a queue cap)."""
        return self.rated or self.max_queued is not None


def read_limits(raw) -> TenantLimits:
    """A stored limits record as every reader takes it (`genpool keys limits` writes it whole):
    fields this version does not know are dropped (a newer tool wrote them), and so is a field
    whose value is invalid, with a warning (the others still apply); a record that is no JSON
    object reads as no limits, with a warning. None (no record): no limits."""
    if raw is None:
        return TenantLimits()
    try:
        doc = json.loads(raw)
    except (ValueError, TypeError, RecursionError) as e:
        log.warning("a tenant's limits record is no JSON; no limits applied: %s", e)
        return TenantLimits()
    if not isinstance(doc, dict):
        log.warning("a tenant's limits record is no JSON object; no limits applied")
        return TenantLimits()
    kept, bad = {}, []
    for k, v in doc.items():  # each field alone: one bad value must not lift the others
        if k in TenantLimits.model_fields:
            try:
                TenantLimits.model_validate({k: v})
                kept[k] = v
            except ValueError:
                bad.append(k)
    if bad:
        log.warning("a tenant's limits record has unreadable %s; applying the rest",
                    ", ".join(bad))
    return TenantLimits.model_validate(kept)

