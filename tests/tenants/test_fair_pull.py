"""Issue 31, fair pull: the deficit-round-robin read (FAIR_READ_LUA) against a real Redis,
deterministically (no worker: the tests read as one, step by step), then a small flood through
in-process workers on the fake engine.

Costs: a job's estimate is ceil(prompt chars / 4) + max_tokens x n (producer/quotas.py), so a
1-character prompt with max_tokens 99 costs 100 tokens."""
from __future__ import annotations

import pytest

from genpool.producer import Client
from genpool.producer.keys_store import KeyStore
from genpool.producer.quotas import estimate_tokens
from genpool.schemas import parse_request
from genpool.schemas.scripting import pipelined
from genpool.schemas.tenant_records import TenantLimits
from genpool.schemas.tenants import DEFAULT_TENANT, FAIR_QUANTUM, TenantKeys
from genpool.workers.fair import FAIR_READ, FairPull
from genpool.workers.streams import ensure_groups, entries_from
from tests.pool_helpers import drop_prefix, new_prefix

COST = 100


@pytest.fixture()
def pool(topology_url):
    """One server, then a local Cluster (the sub-streams share their lane's slot)."""
    prefix = new_prefix("fair")
    c = Client(topology_url, prefix)
    ensure_groups(c.redis, c.keys)
    try:
        yield c
    finally:
        c.close()
        drop_prefix(topology_url, prefix)


def submit(c: Client, tenant: str, n: int, cost: int = COST, priority: int = 0) -> None:
    c.submit_many([{"prompt": "p", "max_tokens": cost - 1, "tenant": tenant,
                    "priority": priority} for _ in range(n)])


def read(c: Client, fair: FairPull, capacity: int) -> list[tuple[str, int, str]]:
    """One worker read of `capacity` entries: (tenant, cost, lane) of each, in reply order."""
    reply = pipelined(c.redis, [0], lambda pipe, shard: fair.queue_read(
        pipe, c.keys, shard, capacity, capacity), [FAIR_READ], raise_errors=True)[0]
    out = []
    for e in entries_from(reply, c.keys):
        req = parse_request(e.fields["job"])
        out.append((req.tenant, estimate_tokens(req), e.lane))
    return out


def serve(c: Client, fair: FairPull, total: int, step: int = 8) -> list[tuple[str, int, str]]:
    got: list = []
    while len(got) < total:
        batch = read(c, fair, min(step, total - len(got)))
        if not batch:
            break
        got += batch
    return got


def tokens(got) -> dict[str, int]:
    out: dict[str, int] = {}
    for tenant, cost, _ in got:
        out[tenant] = out.get(tenant, 0) + cost
    return out


def jain(shares: list[float]) -> float:
    return sum(shares) ** 2 / (len(shares) * sum(x * x for x in shares))


def test_equal_weights_share_tokens_equally(pool):
    submit(pool, "a", 120)
    submit(pool, "b", 120)
    got = serve(pool, FairPull("w1"), 160)
    t = tokens(got)
    assert abs(t["a"] - t["b"]) <= FAIR_QUANTUM + COST, t
    assert jain([t["a"], t["b"]]) >= 0.99
    assert {tenant for tenant, _, _ in got[:60]} == {"a", "b"}  # turns alternate early on


def test_weights_two_to_one(pool):
    KeyStore(pool.redis, pool.keys).set_limits("a", TenantLimits(weight=2))
    fair = FairPull("w1")
    fair.refresh(pool.redis, pool.keys)
    assert fair.weights == {"a": 2}
    submit(pool, "a", 200)
    submit(pool, "b", 200)
    t = tokens(serve(pool, fair, 240))
    assert abs(t["a"] - 2 * t["b"]) <= 2 * (FAIR_QUANTUM + COST), t
    assert jain([t["a"] / 2, t["b"]]) >= 0.95


def test_weights_that_are_no_ascii_numbers_are_ignored(pool):
    """The weights hash is anyone's to write: "²" passed str.isdigit() and int() then raised in
    every worker's refresh."""
    KeyStore(pool.redis, pool.keys).set_limits("a", TenantLimits(weight=3))
    pool.redis.hset(TenantKeys(pool.keys).weights, mapping={"b": "²", "c": "0", "d": "x"})
    fair = FairPull("w1")
    fair.refresh(pool.redis, pool.keys)
    assert fair.weights == {"a": 3}


def test_a_negative_cost_buys_no_credit(pool, monkeypatch):
    """An entry's `cost` is the producer's write: -100,000 on each of n's entries raised n's
    deficit with every read, so n took every turn and s none."""
    from genpool.producer import fair_submit

    real = fair_submit.estimate_tokens
    monkeypatch.setattr(fair_submit, "estimate_tokens",
                        lambda req: -100_000 if req.tenant == "n" else real(req))
    submit(pool, "n", 200)
    monkeypatch.setattr(fair_submit, "estimate_tokens", real)
    submit(pool, "s", 200)
    got = serve(pool, FairPull("w1"), 100)
    n_s = sum(tenant == "s" for tenant, _, _ in got)
    assert n_s >= 30, f"s got {n_s} of 100"


def test_the_default_tenant_takes_turns_too(pool):
    submit(pool, DEFAULT_TENANT, 80)
    submit(pool, "a", 80)
    t = tokens(serve(pool, FairPull("w1"), 100))
    assert abs(t["a"] - t[DEFAULT_TENANT]) <= FAIR_QUANTUM + COST, t


def test_a_tenant_arriving_gets_its_turn_soon_and_one_leaving_leaves_the_ring(pool):
    fair = FairPull("w1")
    submit(pool, "a", 150)
    first = serve(pool, fair, 30)
    assert {tenant for tenant, _, _ in first} == {"a"}  # alone: all of it
    submit(pool, "b", 10)
    nxt = serve(pool, fair, 60)
    per_turn = FAIR_QUANTUM // COST + 1
    assert "b" in [tenant for tenant, _, _ in nxt[:per_turn + 1]], nxt  # within one turn of a
    assert sum(tenant == "b" for tenant, _, _ in nxt) == 10  # all of b's, interleaved
    t = TenantKeys(pool.keys)
    lane = pool.keys.jobs("normal")
    assert pool.redis.lrange(t.fair(lane)[0], 0, -1) == ["a"]  # b drained: it left the ring
    rest = serve(pool, fair, 200)
    assert {tenant for tenant, _, _ in rest} == {"a"} and len(first + nxt + rest) == 160


def test_one_tenants_huge_prompt_puts_it_in_debt_not_ahead(pool):
    """h's 40,000-token job is served in h's turn, then h waits while s gets the tokens back."""
    submit(pool, "h", 1, cost=40_000)
    submit(pool, "h", 100)
    submit(pool, "s", 600)
    got = serve(pool, FairPull("w1"), 500)
    t = tokens(got)
    assert abs(t["h"] - t["s"]) <= FAIR_QUANTUM + 40_000, t
    big = next(i for i, (tenant, cost, _) in enumerate(got) if cost == 40_000)
    after = got[big + 1:]
    s_before_h = next(i for i, (tenant, _, _) in enumerate(after) if tenant == "h")
    assert s_before_h * COST >= 40_000 - 2 * FAIR_QUANTUM  # s got about h's debt first


def test_priorities_keep_their_meaning_across_tenants(pool):
    submit(pool, "a", 40)
    submit(pool, "b", 3, priority=-1)  # interactive
    first = read(pool, FairPull("w1"), 8)
    assert [lane for _, _, lane in first[:3]] == ["high"] * 3
    assert [tenant for tenant, _, _ in first[:3]] == ["b"] * 3


def test_workers_share_one_fair_order(pool):
    """Two workers reading in turn see one round robin, not one each."""
    submit(pool, "a", 100)
    submit(pool, "b", 100)
    w1, w2 = FairPull("w1"), FairPull("w2")
    got = []
    for i in range(20):
        got += read(pool, w1 if i % 2 else w2, 6)
    t = tokens(got)
    assert abs(t["a"] - t["b"]) <= FAIR_QUANTUM + COST, t


def test_turns_are_settled_in_the_tokens_results_really_used(pool):
    """a's jobs are estimated at 1,000 tokens (max_tokens 999) but stop after 100, b's are
    estimated right at 100: once each result gives back what it did not use
    (workers/usage.py settle_after), both are served alike."""
    from genpool.workers.streams import entries_from as parse
    from genpool.workers.usage import UsageCount, settle_after

    submit(pool, "a", 700, cost=1000)
    submit(pool, "b", 700, cost=COST)
    fair, served = FairPull("w1"), {"a": 0, "b": 0}
    for step in range(150):
        if step == 75:  # the credit given back builds up over the first turns: count after
            served = {"a": 0, "b": 0}
        reply = pipelined(pool.redis, [0], lambda pipe, shard: fair.queue_read(
            pipe, pool.keys, shard, 8, 8), [FAIR_READ], raise_errors=True)[0]
        counts = []
        for e in parse(reply, pool.keys):
            tenant = parse_request(e.fields["job"]).tenant
            served[tenant] += 1
            counts.append(UsageCount(tenant, 1, 99, 0, e.stream, int(e.fields["cost"])))
        settle_after(pool.redis, pool.keys, counts)
    assert abs(served["a"] - served["b"]) <= 0.2 * (served["a"] + served["b"]), served
