"""Tenant isolation for `genpool job ...` run with a tenant's API key (issue 31).

Whoever holds the Redis URL may read any job; a command given `--api-key` acts as that key's
tenant, and a job of another tenant is reported exactly like a job that does not exist (no
command tells a tenant that another tenant's job id is in use)."""
from __future__ import annotations

from typing import Optional

from genpool.schemas.tenants import DEFAULT_TENANT

from .keys_store import KeyStore


class BadKey(ValueError):
    """The --api-key given is not a stored key (unknown, expired or revoked)."""


def key_tenant(c, api_key: Optional[str]) -> Optional[str]:
    """The tenant a command acts as: None (no key: an operator), or its key's tenant."""
    if api_key is None:
        return None
    key = KeyStore(c.redis, c.keys).find(api_key)
    if key is None:
        raise BadKey("the API key given is not valid (unknown, expired or revoked)")
    return key.tenant


def visible(view: Optional[dict], tenant: Optional[str]) -> Optional[dict]:
    """`view` (producer/cli_jobs.job_view) when `tenant` may see it, else None (no such job)."""
    if view is None or tenant is None:
        return view
    return view if view.get("tenant", DEFAULT_TENANT) == tenant else None
