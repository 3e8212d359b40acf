"""map_prompts: input order, the concurrency bound, failures in place, fail-fast validation.

A fake engine in an in-process worker (exact, model-free outputs) keeps this fast.
"""
from __future__ import annotations

import pytest

from genpool.producer import Client
from genpool.producer.pipeline import map_prompts
from tests.fake_engine import FakeEngine, expected_for_prompt
from tests.pool_helpers import drop_prefix, new_prefix, worker_thread


class CountingClient(Client):
    """Records how many jobs were out (submitted, result not yet handed back) at the peak."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.out = self.peak = self.submitted = 0

    def submit_many(self, requests):
        self.out += len(requests)
        self.submitted += len(requests)
        self.peak = max(self.peak, self.out)
        return super().submit_many(requests)


@pytest.fixture
def fake_pool(topology_url):
    """One server, then a 3-master Redis Cluster (tests/conftest.py)."""
    redis_url, prefix = topology_url, new_prefix("map")
    with worker_thread(FakeEngine(max_num_seqs=16, step_delay=0.002), redis_url, prefix):
        yield CountingClient(redis_url, prefix)
    drop_prefix(redis_url, prefix)


def test_map_keeps_order_and_bound(fake_pool):
    c = fake_pool
    # Later items are shorter, so they finish first: order must come from the input, not timing.
    prompts = [f"document {i}" for i in range(40)]
    items = [{"prompt": p, "max_tokens": 40 - i} for i, p in enumerate(prompts)]
    items[5] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    seen = []

    def on_result(i, res):
        c.out -= 1
        seen.append(i)

    results = map_prompts(c, items, concurrency=6, on_result=on_result, temperature=0.0)
    assert c.peak <= 6 and c.submitted == 40
    assert sorted(seen) == list(range(40)) and seen != list(range(40))
    for i, (item, res) in enumerate(zip(items, results)):
        assert res.ok, res.error
        if i != 5:
            assert res.text == expected_for_prompt(item["prompt"], item["max_tokens"])
    assert results[5].usage.completion_tokens == 3


def test_map_failures_stay_in_place(fake_pool):
    results = map_prompts(fake_pool, ["a", {"prompt": "b", "model": "nope"}, "c"],
                          concurrency=2, max_tokens=4)
    assert [r.ok for r in results] == [True, False, True]
    assert results[1].error.code == "unknown_model"
    assert results[2].text == expected_for_prompt("c", 4)


def test_map_validates_everything_first(fake_pool):
    with pytest.raises(ValueError, match="temperature"):
        map_prompts(fake_pool, ["a", {"prompt": "b", "temperature": -1}], max_tokens=2)
    assert fake_pool.submitted == 0
    with pytest.raises(ValueError, match="job_id"):
        map_prompts(fake_pool, [{"prompt": "a", "job_id": "x"}, {"prompt": "b", "job_id": "x"}])
