"""Issue 31: a flood end to end, small (tests/tenant_flood.py): A and C each queue 150 jobs at
once, B sends 10 at a steady rate, one in-process worker on the fake engine serves them all.
With fair pull B's jobs overtake the backlog; without it (every job the default tenant's, in
arrival order) they wait behind all of it. A and C, both backlogged, get equal tokens."""
from __future__ import annotations

from tests.tenant_flood import Flood, run


def test_fair_pull_keeps_a_trickle_moving_behind_two_floods(redis_url):
    fair = run(redis_url, Flood(fair=True))
    unfair = run(redis_url, Flood(fair=False))
    print(f"fair: {fair}\nunfair: {unfair}")
    assert fair["jain"] >= 0.95, fair
    assert fair["b_p50_s"] * 5 < unfair["b_p50_s"], (fair, unfair)


def test_fair_pull_through_sentinel(redis_sentinel):
    """The same flood, smaller, against a master found through Sentinel."""
    fair = run(redis_sentinel.url, Flood(fair=True, flood_jobs=40, trickle_jobs=5))
    assert fair["jain"] >= 0.95, fair
