"""Issue 31: through the gateway, a tenant's key reads, streams and cancels only its tenant's
jobs (/v1/jobs/{id}); another tenant's job answers 404 exactly as an unknown id does. Real
Redis, a real gateway (uvicorn in a thread) and an in-process worker on the fake engine."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.tenants.test_keys_quotas import STATIC, keyed_gateway


@pytest.fixture()
def gateway(redis_url):
    with keyed_gateway(redis_url, "gwjobs") as (url, store, _, prefix):
        yield url, store.create("team-a", [], 1)[0], store.create("team-b", [], 1)[0], redis_url, prefix


def call(method: str, url: str, key: str, **kw) -> httpx.Response:
    return httpx.request(method, url, headers={"Authorization": f"Bearer {key}"}, timeout=30, **kw)


def test_a_tenant_sees_only_its_own_jobs_through_the_gateway(gateway):
    base, key_a, key_b, _, _ = gateway
    done = call("POST", f"{base}/v1/completions", key_a,
                json={"model": "fake", "prompt": "hello", "max_tokens": 3})
    assert done.status_code == 200, done.text
    job_id = done.json()["id"].split("-", 1)[1]
    mine = call("GET", f"{base}/v1/jobs/{job_id}", key_a)
    assert mine.status_code == 200 and mine.json()["tenant"] == "team-a"
    assert mine.json()["state"] == "done" and mine.json()["result"]["text"] == \
        done.json()["choices"][0]["text"]
    with httpx.stream("GET", f"{base}/v1/jobs/{job_id}/events", timeout=30,
                      headers={"Authorization": f"Bearer {key_a}"}) as s:
        lines = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
    events = [json.loads(x) for x in lines[:-1]]
    assert lines[-1] == "[DONE]" and events[-1]["type"] == "result"
    assert "".join(e.get("text", "") for e in events[:-1]) == events[-1]["text"]
    unknown = call("GET", f"{base}/v1/jobs/no-such-job", key_b)
    for method, path in (("GET", ""), ("GET", "/events"), ("POST", "/cancel")):
        theirs = call(method, f"{base}/v1/jobs/{job_id}{path}", key_b)
        assert theirs.status_code == 404, (path, theirs.text)
        assert theirs.json()["error"]["message"].replace(job_id, "X") == \
            unknown.json()["error"]["message"].replace("no-such-job", "X")
    assert call("GET", f"{base}/v1/jobs/{job_id}", STATIC).status_code == 200  # the operator
    assert call("GET", f"{base}/v1/jobs/a:b{{c}}", key_a).status_code == 404  # no key spelled


def test_a_tenant_cancels_its_running_job_and_not_anothers(gateway):
    from genpool.producer import Client
    from tests.pool_helpers import wait_for

    base, key_a, key_b, url, prefix = gateway
    with Client(url, prefix, tenant="team-a") as client:
        job = client.submit("x", max_tokens=100_000, model="fake")
        assert call("POST", f"{base}/v1/jobs/{job.id}/cancel", key_b).status_code == 404
        cancelled = call("POST", f"{base}/v1/jobs/{job.id}/cancel", key_a)
        assert cancelled.status_code == 200 and cancelled.json()["id"] == job.id
        wait_for(lambda: call("GET", f"{base}/v1/jobs/{job.id}", key_a).json()["state"]
                 == "cancelled", 30, what="the job cancelled")
