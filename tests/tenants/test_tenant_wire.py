"""Issue 31, part 1: the `tenant` field on the wire, and every producer that carries it.

Real Redis (one server and a local Cluster, whose submit takes another path)."""
from __future__ import annotations

import asyncio
import json

import pytest

from genpool.producer import Client
from genpool.producer.aio import AsyncClient
from genpool.schemas import parse_request
from genpool.schemas.request import JobRequest
from genpool.schemas.tenants import DEFAULT_TENANT, TenantKeys, sub_stream
from tests.pool_helpers import drop_prefix, new_prefix


def lane_jobs(c: Client) -> list[dict]:
    """Every queued job: on the lane streams, and (a tenant's) on the lanes' sub-streams."""
    out = []
    t = TenantKeys(c.keys)
    for lane in c.lane_keys().all_jobs():
        subs = [sub_stream(lane, m) for m in c.redis.smembers(t.fair(lane)[2])]
        for key in [lane, *subs]:
            out += [json.loads(f["job"]) for _, f in c.redis.xrange(key)]
    return out


def test_a_job_without_a_tenant_is_the_default_one_and_keeps_the_old_wire():
    req = JobRequest(prompt="x")
    assert req.tenant == DEFAULT_TENANT
    assert "tenant" not in json.loads(req.to_wire())  # a worker from before tenants reads it
    back = parse_request(JobRequest(prompt="x", tenant="acme-1").to_wire())
    assert back.tenant == "acme-1"


@pytest.mark.parametrize("bad", ["", "a:b", "{x}", "a b", "x" * 65, 7])
def test_a_bad_tenant_is_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="tenant"):
        parse_request({"prompt": "x", "tenant": bad})


@pytest.mark.parametrize("bad", ["", "a:b", "{x}"])
def test_a_client_with_a_bad_tenant_is_refused_before_any_submit(bad):
    with pytest.raises(ValueError, match="invalid tenant"):
        Client("redis://127.0.0.1:6379/9", new_prefix("tw"), tenant=bad)


def test_client_tenant_lands_on_the_lane_entry_and_the_job_hash(topology_url):
    prefix = new_prefix("tw")
    c = Client(topology_url, prefix, tenant="acme")
    try:
        a = c.submit("hi", job_id="ta")
        b = c.submit("hi", job_id="tb", tenant="bulk")  # a per-job tenant wins
        c.submit_many([{"prompt": "x", "job_id": "tc"}])
        plain = Client(topology_url, prefix)
        plain.submit("hi", job_id="td")
        plain.close()
        got = {j["id"]: j.get("tenant", DEFAULT_TENANT) for j in lane_jobs(c)}
        assert got == {"ta": "acme", "tb": "bulk", "tc": "acme", "td": DEFAULT_TENANT}
        assert c.redis.hget(c.keys.job(a.id), "tenant") == "acme"
        assert c.redis.hget(c.keys.job(b.id), "tenant") == "bulk"
        assert c.redis.hget(c.keys.job("td"), "tenant") == DEFAULT_TENANT
    finally:
        c.close()
        drop_prefix(topology_url, prefix)


def test_async_client_carries_its_tenant(redis_url):
    prefix = new_prefix("tw")

    async def go():
        ac = AsyncClient(redis_url, prefix, tenant="acme")
        try:
            await ac.submit("hi", job_id="aa")
            await ac.submit_many([{"prompt": "x", "job_id": "ab"}])
        finally:
            await ac.close()

    try:
        asyncio.run(go())
        c = Client(redis_url, prefix)
        assert {j["id"]: j["tenant"] for j in lane_jobs(c)} == {"aa": "acme", "ab": "acme"}
        assert c.redis.hget(c.keys.job("aa"), "tenant") == "acme"
        c.close()
    finally:
        drop_prefix(redis_url, prefix)
