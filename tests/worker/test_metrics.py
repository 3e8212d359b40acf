"""Prometheus /metrics of a real worker (tiny model, real Redis) agree with what happened.

A worker runs in a thread of this process with `attach_metrics` (what `--metrics-port` does);
the test scrapes its HTTP endpoint while a long job runs and after everything finished, and
compares the counters with the token events a reader saw on each job's stream.
"""
from __future__ import annotations

import os
import threading
import urllib.request
import uuid

import pytest
import redis

from genpool.producer import Client
from genpool.schemas import Keys
from tests.pool_helpers import drop_prefix, new_prefix, wait_for

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
pytest.importorskip("prometheus_client", reason="the worker extra is not installed")


def scrape(port: int) -> dict:
    """{(name, frozenset(labels)): value} from the worker's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(m: dict, name: str, **labels) -> float:
    """Sum of every series of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in m.items() if n == name and want <= ls)


@pytest.fixture(scope="module")
def served(tiny_llama_path, redis_url):
    """A tiny-model worker with metrics on a free port; yields (client, port, keys)."""
    from genpool.engine import LLM
    from genpool.workers.integrations.metrics import attach_metrics
    from genpool.workers.worker import Worker, WorkerConfig

    prefix = new_prefix("metrics")
    engine = LLM(str(tiny_llama_path), max_num_seqs=8, num_threads=1).llm_engine
    cfg = WorkerConfig(name=f"m-{uuid.uuid4().hex[:6]}", served_models=frozenset({"tiny"}),
                       heartbeat_s=0.5)
    w = Worker(engine, redis.Redis.from_url(redis_url, socket_timeout=10), Keys(prefix), cfg)
    obs = attach_metrics(w, 0, redis_url, addr="127.0.0.1")
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    client = Client(redis_url, prefix)
    try:
        yield client, obs.server.server_port, Keys(prefix)
    finally:
        w.stop(drain_timeout_s=5)
        t.join(30)
        obs.server.shutdown()
        client.close()
        drop_prefix(redis_url, prefix)


def streamed_tokens(job) -> tuple[int, int, int]:
    """(token ids seen on the job's stream, token events, completions) as a reader sees them."""
    ids = events = 0
    completions = set()
    for ev in job.events(timeout=120):
        if ev.type == "token":
            ids += len(ev.token_ids)
            events += 1
            completions.add(ev.index)
    return ids, events, len(completions)


def test_metrics_agree_with_the_run(served):
    client, port, keys = served
    before = scrape(port)
    assert value(before, "genpool:generation_tokens_total") == 0
    long = client.submit("Count slowly:", max_tokens=400, ignore_eos=True, temperature=0.0)
    next(long.stream(timeout=60))  # running now
    during = scrape(port)
    assert value(during, "genpool:num_requests_running") >= 1
    assert 0 < value(during, "genpool:kv_cache_usage_perc") <= 1
    assert value(during, "genpool:queue_pending", lane="normal") == 1

    specs = [dict(prompt=f"Item {i}: the river and the stone", max_tokens=3 + i,
                  temperature=0.0) for i in range(4)]
    specs.append(dict(messages=[{"role": "user", "content": "Hello there"}], max_tokens=6,
                      temperature=0.7, seed=3, n=2))
    specs.append(dict(prompt="Bulk lane", priority=5, max_tokens=5, temperature=0.0))
    jobs = [long] + [client.submit(**s) for s in specs]
    bad = client.submit("Nobody serves this", model="no-such-model")
    counts = [streamed_tokens(j) for j in jobs]
    results = [j.result(timeout=120) for j in jobs]
    assert all(r.ok for r in results) and not bad.result(timeout=60, raise_on_error=False).ok
    redis.Redis.from_url(client.url).xadd(keys.jobs("normal"), {"junk": "no job field"})
    wait_for(lambda: client.redis.xlen(keys.dead) == 1, 30, what="dead letter")

    after = wait_for(lambda: (m := scrape(port)) and
                     value(m, "genpool:queue_pending") == 0 and m, 30, what="idle worker")
    tokens = sum(c[0] for c in counts)
    assert value(after, "genpool:generation_tokens_total") == tokens
    assert tokens == sum(r.usage.completion_tokens for r in results)
    assert value(after, "genpool:prompt_tokens_total") == sum(r.usage.prompt_tokens
                                                             for r in results)
    assert value(after, "genpool:request_success_total") == len(jobs)
    assert value(after, "genpool:request_success_total", finished_reason="length") >= 5
    assert value(after, "genpool:request_failure_total", code="unknown_model") == 1
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds"):
        assert value(after, f"genpool:{h}_count") == len(jobs), h
    # one gap per token event after each completion's first (decode: one token per event)
    gaps = sum(c[1] - c[2] for c in counts)
    assert value(after, "genpool:inter_token_latency_seconds_count") == gaps
    assert value(after, "genpool:num_requests_running") == 0
    assert value(after, "genpool:queue_length") == 0
    assert value(after, "genpool:dead_letters") == 1
    assert value(after, "genpool:redis_up") == 1
    assert value(after, "genpool:prefix_cache_queries_total") > 0
    assert value(after, "genpool:engine_steps_total") >= 400
    assert value(after, "genpool:e2e_request_latency_seconds_sum") > 0
