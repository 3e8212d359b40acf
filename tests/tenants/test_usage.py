"""Issue 31, part 4: usage per tenant, counted once with the result; `genpool usage`.

Real Redis (one server and a local Cluster), an in-process worker on the fake engine, the CLI."""
from __future__ import annotations

import json
import subprocess
import sys
import time

from genpool.producer import Client
from genpool.schemas import Keys, ResultEvent
from genpool.schemas.connection import connect
from genpool.schemas.tenants import USAGE_BUCKET_S, TenantKeys
from genpool.workers.usage import UsageCount, queue_final
from tests.fake_engine import FakeEngine
from tests.pool_helpers import ROOT, drop_prefix, new_prefix, worker_thread


def usage_cli(url: str, prefix: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-P", "-m", "genpool.workers.cli.main", "usage",
                          "--json", "--redis", url, "--prefix", prefix, *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["tenants"]


def test_each_tenants_tokens_are_counted_once_with_its_results(topology_url):
    prefix = new_prefix("use")
    a, b = Client(topology_url, prefix, tenant="a"), Client(topology_url, prefix, tenant="b")
    try:
        with worker_thread(FakeEngine(max_num_seqs=4), topology_url, prefix):
            jobs = [a.submit(f"prompt {i} " * (i + 1), max_tokens=3 + i) for i in range(3)]
            jobs += [b.submit("hello there", max_tokens=5) for _ in range(2)]
            results = [j.result(timeout=60) for j in jobs]
        want: dict = {}
        for job, res in zip(jobs, results):
            row = want.setdefault(job.client.tenant, {"prompt": 0, "completion": 0, "jobs": 0})
            row["prompt"] += res.usage.prompt_tokens
            row["completion"] += res.usage.completion_tokens
            row["jobs"] += 1
        got = usage_cli(topology_url, prefix)
        assert {t: {k: v[k] for k in ("prompt", "completion", "jobs")} for t, v in got.items()} \
            == want
        assert got["a"]["total"] == want["a"]["prompt"] + want["a"]["completion"]
        assert list(usage_cli(topology_url, prefix, "--tenant", "b")) == ["b"]
        r = connect(topology_url, decode_responses=True)
        hour = TenantKeys(Keys(prefix)).usage(int(time.time()) // USAGE_BUCKET_S)
        assert r.ttl(hour) > 0
        r.close()
    finally:
        a.close()
        b.close()
        drop_prefix(topology_url, prefix)


def test_a_resent_final_write_counts_nothing_more(redis_url):
    """The write that carries the count is fenced: once it landed, the same write again (a
    resend after a lost reply, or a replaced worker's late write) is refused, count and all."""
    prefix = new_prefix("use")
    keys = Keys(prefix)
    r = connect(redis_url, decode_responses=True)
    try:
        Client(redis_url, prefix, tenant="a").submit("x", job_id="j1")
        r.hset(keys.job("j1"), mapping={"owner": "tok-1", "state": "running"})
        ev = ResultEvent(text="hi", finish_reason="stop")
        ev.usage.prompt_tokens, ev.usage.completion_tokens = 7, 2
        u = UsageCount("a", 7, 2, int(time.time()) // USAGE_BUCKET_S)
        landed = []
        for token in ("tok-1", "tok-1", "tok-old"):
            pipe = r.pipeline(transaction=False)
            queue_final(pipe, keys, "j1", token, [100, 60, "done", "result", "1.0", "w"],
                        [ev.model_dump_json()], u)
            landed += pipe.execute()
        assert landed == [1, 0, 0]
        assert r.hgetall(u.bucket(keys)) == {"a:prompt": "7", "a:completion": "2", "a:jobs": "1"}
        assert r.hget(keys.job("j1"), "state") == "done"
    finally:
        r.close()
        drop_prefix(redis_url, prefix)


def test_usage_refuses_a_bad_since(redis_url):
    out = subprocess.run([sys.executable, "-P", "-m", "genpool.workers.cli.main", "usage",
                          "--since", "yesterday-ish", "--redis", redis_url, "--prefix",
                          new_prefix("use")], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "--since" in out.stderr


def test_tenant_metrics_keep_a_bounded_label_set():
    from prometheus_client import CollectorRegistry

    from genpool.workers.integrations.tenant_metrics import TenantCounters

    reg = CollectorRegistry()
    c = TenantCounters("fake", reg, max_labels=3)
    for i in range(10):
        c.finished(f"t{i}", 10, 1)
    c.finished("t0", 5, 2)
    value = reg.get_sample_value
    labels = {s.labels["tenant"] for m in reg.collect() for s in m.samples
              if m.name == "genpool:tenant_prompt_tokens"}
    assert labels == {"t0", "t1", "t2", "other"}
    assert value("genpool:tenant_prompt_tokens_total", {"model_name": "fake", "tenant": "t0"}) == 15
    assert value("genpool:tenant_prompt_tokens_total",
                 {"model_name": "fake", "tenant": "other"}) == 70
    assert value("genpool:tenant_request_success_total",
                 {"model_name": "fake", "tenant": "other"}) == 7


def test_tenant_metric_labels_go_to_the_top_tenants_by_usage_first(redis_url):
    """The label set is bounded (the top N tenants plus "other"): at start, the top N by the
    last day's usage hashes get their labels, whoever the worker happens to see first."""
    from prometheus_client import CollectorRegistry

    from genpool.workers.integrations.metrics import top_tenants
    from genpool.workers.integrations.tenant_metrics import TenantCounters

    prefix = new_prefix("toplabels")
    keys, r = Keys(prefix), connect(redis_url, decode_responses=True)
    try:
        hour = int(time.time()) // USAGE_BUCKET_S
        bucket = TenantKeys(keys).usage(hour)
        for i in range(6):  # t5 used the most, t0 the least
            r.hset(bucket, mapping={f"t{i}:prompt": 100 * (i + 1), f"t{i}:completion": 1,
                                    f"t{i}:jobs": 1})
        r.expire(bucket, 3600)
        ranked = top_tenants(redis_url, keys)
        assert ranked == ["t5", "t4", "t3", "t2", "t1", "t0"]
        reg = CollectorRegistry()
        c = TenantCounters("fake", reg, max_labels=2)
        c.seed(ranked)
        for t in ("t0", "t1", "t5", "t4", "new"):  # small tenants seen first
            c.finished(t, 1, 1)
        labels = {s.labels["tenant"] for m in reg.collect() for s in m.samples
                  if m.name == "genpool:tenant_prompt_tokens"}
        assert labels == {"t5", "t4", "other"}
        assert top_tenants("redis://127.0.0.1:1/0", keys) == []  # no Redis: labels as seen
    finally:
        r.close()
        drop_prefix(redis_url, prefix)
