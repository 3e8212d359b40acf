"""Hypothesis-driven hostile input interleaved with valid jobs, against a real worker process.

Each bad job must get a clear error on its own stream, junk must be dead-lettered, the worker must
stay up, and every valid job must finish with the offline engine's output.
"""
from __future__ import annotations

import json
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from genpool.producer import Client
from tests.pool_helpers import (
    check,
    collect,
    drop_prefix,
    new_prefix,
    offline,
    spawn_worker,
    stop_proc,
    wait_for,
    workers_alive,
)

# kind -> (error code, text the message must contain); None: dead-lettered (no job id)
EXPECT = {
    "bad_json": ("invalid_request", "not valid JSON"),
    "wrong_type": ("invalid_request", "Input should be a valid"),
    "huge_prompt": ("invalid_request", "prompt: String should have at most 1000000"),
    "too_many_tokens": ("invalid_request", "the model's limit is"),
    "negative_max_tokens": ("invalid_request", "max_tokens: Input should be greater than"),
    "unknown_model": ("unknown_model", "is not served here"),
    "invalid_utf8": ("invalid_request", "not valid UTF-8"),
    "unknown_field": ("invalid_request", "unknown field"),
    "junk": None,
}
KINDS = ["valid", "valid", *EXPECT]
WRONG = {"prompt": [[1, 2], {"a": 1}, 5, True], "max_tokens": ["ten", [1], 1.5, True],
         "temperature": ["hot", [0.5], True], "stop": [5, {"s": 1}], "seed": ["x", 2.5, False]}
safe_text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1,
                    max_size=40)


@st.composite
def item(draw) -> tuple[str, str, object]:
    """(kind, job id, payload): payload is submit kwargs (valid) or raw XADD fields."""
    kind, jid = draw(st.sampled_from(KINDS)), f"h-{uuid.uuid4().hex[:10]}"
    base = {"id": jid, "prompt": draw(safe_text), "max_tokens": draw(st.integers(1, 6))}
    if kind == "valid":
        return kind, jid, {"job_id": jid, "prompt": base["prompt"],
                           "max_tokens": base["max_tokens"], "temperature": 0.0}
    if kind == "bad_json":
        raw = json.dumps(base)[:-draw(st.integers(1, 5))].encode()
    elif kind == "wrong_type":
        field = draw(st.sampled_from(sorted(WRONG)))
        base[field] = draw(st.sampled_from(WRONG[field]))
        raw = json.dumps(base).encode()
    elif kind == "huge_prompt":
        raw = json.dumps(dict(base, prompt="z" * 1_000_001)).encode()
    elif kind == "too_many_tokens":
        raw = json.dumps(dict(base, prompt=" ".join(["harbor lamp"] * 1500))).encode()
    elif kind == "negative_max_tokens":
        raw = json.dumps(dict(base, max_tokens=draw(st.integers(-10**6, 0)))).encode()
    elif kind == "unknown_model":
        raw = json.dumps(dict(base, model="m-" + draw(safe_text))).encode()
    elif kind == "invalid_utf8":
        raw = json.dumps(base).encode().replace(b'"prompt": "', b'"prompt": "\xc3\x28\xff', 1)
    elif kind == "unknown_field":
        name = draw(st.text("abcdefghijklmnopqrstuvwxyz_", min_size=3, max_size=12))
        raw = json.dumps(dict(base, **{"x_" + name: 1})).encode()
    else:  # junk: random fields, or a `job` nobody can attribute to a job id
        fields = draw(st.dictionaries(st.binary(min_size=1, max_size=8).filter(lambda b: b != b"job"),
                                      st.binary(max_size=30), min_size=1, max_size=3)
                      | st.builds(lambda b: {b"job": b}, st.binary(max_size=50).filter(
                          lambda b: b'"id"' not in b)))
        return kind, jid, fields
    return kind, jid, {b"job": raw}


@pytest.fixture(scope="module")
def hostile_pool(redis_url, tiny_llama_path, tmp_path_factory):
    prefix = new_prefix("hostile")
    log = tmp_path_factory.mktemp("hostile") / "worker.log"
    proc = spawn_worker(redis_url, prefix, tiny_llama_path, "hw", "--max-num-seqs", "16",
                        log_path=log)
    wait_for(lambda: workers_alive(redis_url, prefix) >= 1, timeout=180, what="worker up")
    yield Client(redis_url, prefix), proc
    stop_proc(proc)
    drop_prefix(redis_url, prefix)


@pytest.fixture(scope="module")
def tiny_llm_module(tiny_llama_path):
    from genpool.engine import LLM

    return LLM(str(tiny_llama_path), max_num_seqs=16, num_threads=1)


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(items=st.lists(item(), min_size=3, max_size=10))
def test_hostile_input_interleaved_with_valid_jobs(hostile_pool, tiny_llm_module, items):
    client, proc = hostile_pool
    dead_before = client.redis.xlen(client.keys.dead)
    valid, bad = [], []
    for kind, jid, payload in items:  # in order, so bad and good entries interleave
        if kind == "valid":
            valid.append((payload, client.submit(**payload)))
        else:
            client.redis.xadd(client.keys.jobs("normal"), payload)
            bad.append((kind, jid))
    for kind, jid in bad:
        if EXPECT[kind] is None:
            continue
        err = client.job(jid).result(timeout=60, raise_on_error=False).error
        assert err is not None and err.code == EXPECT[kind][0], (kind, err)
        assert EXPECT[kind][1] in err.message, (kind, err.message)
    n_junk = sum(EXPECT[k] is None for k, _ in bad)
    wait_for(lambda: client.redis.xlen(client.keys.dead) == dead_before + n_junk, timeout=30,
             what=f"{n_junk} new dead letters")
    check(collect(client, [job for _, job in valid]),
          offline(tiny_llm_module, [spec for spec, _ in valid]))
    assert proc.poll() is None, "the worker died"
    # a result lands first and its entry is acknowledged in the next round trip (workers/outbox.py),
    # so the lanes drain a moment after the last result: wait for it, never longer than 10 s
    wait_for(lambda: all(v == {"queued": 0, "pending": 0} for v in client.status()["lanes"].values()),
             timeout=10, what=lambda: f"every lane drained (now {client.status()['lanes']})")
