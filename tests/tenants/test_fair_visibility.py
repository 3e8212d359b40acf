"""Issue 31, fair pull: jobs queued on tenants' sub-streams are counted where queue depth is
shown or enforced: `genpool status` (Client.status) and the gateway's --max-queue-depth."""
from __future__ import annotations

import httpx

from genpool.producer import Client
from tests.pool_helpers import client_env
from tests.producer.test_gateway_limits import serve


def test_status_counts_the_tenants_queued_jobs(redis_url):
    with client_env(redis_url, "fairvis") as (url, prefix, c):
        c.submit_many([{"prompt": "x", "tenant": "acme"} for _ in range(3)])
        c.submit_many([{"prompt": "x", "tenant": "beta", "priority": 1} for _ in range(2)])
        c.submit("plain")
        lanes = c.status()["lanes"]
        assert lanes["normal"]["queued"] == 4 and lanes["low"]["queued"] == 2


def test_the_gateways_queue_depth_limit_counts_tenants_jobs(redis_url):
    from genpool.producer.gateway import create_app

    with client_env(redis_url, "fairgw") as (url, prefix, c):
        Client(url, prefix, tenant="acme").submit_many([{"prompt": "x"} for _ in range(3)])
        app = create_app(url, prefix, max_queue_depth=2, queue_without_workers=True)
        with serve(app) as port:
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                           json={"model": "fake", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.text


def test_jobs_list_shows_the_tenants_queued_jobs(redis_url):
    from genpool.producer.listing import list_jobs
    from genpool.schemas.connection import connect

    with client_env(redis_url, "fairls") as (url, prefix, c):
        c.submit("plain", job_id="p1")
        Client(url, prefix, tenant="acme").submit("x", job_id="t1", priority=1)
        c.cancel("t1")
        raw = connect(url, decode_responses=False)
        rows = {row["id"]: (row["lane"], row["state"]) for row in list_jobs(raw, c.lane_keys())}
        raw.close()
        assert rows == {"p1": ("normal", "queued"), "t1": ("low", "cancelled")}
        assert c.status()["cancelled"]["low"] == 1


def test_lanes_check_and_repair_cover_a_tenants_sub_stream(redis_url):
    """A sub-stream whose ids ran out (a raw XADD of the last id) is found and mended like a
    lane, and the tenant's jobs all run."""
    import json

    from genpool.producer.cli_lanes import lane_states, repair_lanes
    from genpool.schemas.tenants import sub_stream
    from tests.fake_engine import FakeEngine, expected_for_prompt
    from tests.pool_helpers import worker_thread

    with client_env(redis_url, "fairfix") as (url, prefix, c):
        t = Client(url, prefix, tenant="acme")
        first = t.submit("p 0", max_tokens=2)
        sub = sub_stream(c.keys.jobs("normal"), "acme")
        c.redis.xadd(sub, {"job": json.dumps({"id": "forged", "prompt": "p forged",
                                              "max_tokens": 2, "tenant": "acme"})},
                     id="18446744073709551615-18446744073709551615")
        assert [s.stream for s in lane_states(c, 60) if s.poisoned] == [sub]
        repair_lanes(c, 60)
        assert not any(s.poisoned for s in lane_states(c, 60))
        late = t.submit("p late", max_tokens=2)
        with worker_thread(FakeEngine(), url, prefix):
            for job, prompt in ((first, "p 0"), (late, "p late"), (c.job("forged"), "p forged")):
                assert job.result(timeout=15).text == expected_for_prompt(prompt, 2)
        t.close()
