"""Issue 28, items 1 and 6: a live Redis that answers writes with an error.

1. Memory pressure under `noeviction`: the ownership claim's first write refused ("OOM command
   not allowed") sent the entry down the dead-letter path, whose XADD was refused while the
   XACK + XDEL pipelined with it passed: jobs lost silently, left `queued` forever.
6. A refused token write (NOREPLICAS, OOM, READONLY) was only logged: readers missed tokens.
Each test runs against a private redis-server whose config it changes (never the shared one).
"""
from __future__ import annotations

import threading
import time

import pytest

from genpool.producer import Client
from tests.chaos_helpers import pool_problems
from tests.fake_engine import FakeEngine, expected_for_prompt
from tests.pool_helpers import drop_prefix, new_prefix, wait_for, worker_thread
from tests.worker.refusal_helpers import (
    memory_pressure,
    private_server,
    reader_text,
    refusals,
    refused_writes,
    server_binaries,
)

BINARIES = server_binaries()


@pytest.fixture(params=sorted(BINARIES))
def private(request, tmp_path):
    """(url, prefix, Client) on a redis-server of this test's own, once per server version
    found here (6.2 and 7 word their script errors differently)."""
    with private_server(BINARIES[request.param], tmp_path / "redis") as url:
        prefix = new_prefix("refused")
        c = Client(url, prefix)
        try:
            yield url, prefix, c
        finally:
            c.close()


def terminal_count(c: Client, job_id: str) -> int:
    return sum('"type":"result"' in f["event"] or '"type":"error"' in f["event"]
               for _, f in c.redis.xrange(c.keys.events(job_id)))


def test_memory_pressure_loses_no_queued_job(private):
    """Item 1, scaled down: 30 jobs, a 2-slot worker, writes refused for 3 s (3 claim windows,
    so the worker also reclaims entries while the server refuses). Every job must finish, with
    one result each; nothing may be dead-lettered, left queued or pending."""
    url, prefix, c = private
    specs = [dict(prompt=f"oom {i}", max_tokens=30) for i in range(30)]
    jobs = c.submit_many(specs)
    with worker_thread(FakeEngine(max_num_seqs=2, step_delay=0.01), url, prefix,
                       claim_idle_ms=1000, heartbeat_s=0.2) as w:
        wait_for(lambda: len(w.jobs.running) == 2, what="2 jobs running")
        with memory_pressure(c.redis):
            time.sleep(3.0)
        assert refusals(c.redis, "OOM") > 0, "the pressure refused nothing"
        wait_for(lambda: all(terminal_count(c, j.id) for j in jobs), timeout=30,
                 what=lambda: f"every job ended; {sum(not terminal_count(c, j.id) for j in jobs)}"
                              f" never did, dead letters {c.redis.xlen(c.keys.dead)}, "
                              f"lanes {c.status()['lanes']}")
    assert pool_problems(c, jobs) == {}
    for spec, job in zip(specs, jobs):
        assert job.result(timeout=1).text == expected_for_prompt(spec["prompt"], 30)
    assert c.redis.xlen(c.keys.dead) == 0


class GatedEngine(FakeEngine):
    """Stops before step `hold_at` until its gate opens: the test decides when jobs finish."""

    def __init__(self, hold_at: int, **kw):
        super().__init__(**kw)
        self.hold_at, self.gate, self.holding = hold_at, threading.Event(), threading.Event()

    def step(self):
        if self.step_count + 1 == self.hold_at:
            self.holding.set()
            self.gate.wait(30)
        return super().step()


def test_refused_results_and_claims_are_held_and_retried(private):
    """Two jobs finish just as memory pressure begins: their results are refused, their slots
    free up, and the worker reads two new entries whose claims are refused too. For 3 claim
    windows nothing may be reclaimed or rerun (the entries are held, the results kept); then
    every job ends once, on its first attempt, and nothing is dead-lettered."""
    url, prefix, c = private
    eng = GatedEngine(hold_at=2, max_num_seqs=2)  # 2 tokens each: they end in step 2
    first = c.submit_many([dict(prompt=f"first {i}", max_tokens=2) for i in range(2)])
    # held entries refreshed every 0.1 s: 0.9 s to spare under the 1 s window for a CI stall
    # of the lease thread (0.7 s seen). A stopped refresh still shows: the two slots stay
    # taken (the claims held count as pending), so the worker never reclaims its own entries,
    # which would reset their idle time.
    with worker_thread(eng, url, prefix, claim_idle_ms=1000, heartbeat_s=0.1) as w:
        wait_for(eng.holding.is_set, what="the first two jobs one step from their end")
        queued = c.submit_many([dict(prompt=f"queued {i}", max_tokens=2) for i in range(6)])
        with memory_pressure(c.redis):
            eng.gate.set()
            wait_for(lambda: w.admission.preparer.unclaimed, interval=0.005, what="a refused claim held")
            time.sleep(3.0)
            idle = {p["message_id"]: p["time_since_delivered"] for p in c.redis.xpending_range(
                c.keys.jobs("normal"), c.keys.group, "-", "+", 100)}
        # the two results and the two claims waiting for Redis: held, so no peer could take
        # them over (their idle time stayed below the claim window all along)
        assert len(idle) == 4 and max(idle.values()) < 1000, idle
        jobs = first + queued
        results = [j.result(timeout=20) for j in jobs]
    assert all(r.ok for r in results)
    assert pool_problems(c, jobs) == {}
    assert {c.job(j.id).info()["attempts"] for j in jobs} == {"1"}, "a job was run again"
    assert c.redis.xlen(c.keys.dead) == 0 and w.counts["lost"] == 0


def test_refused_token_writes_are_resent(private):
    """Item 6: NOREPLICAS for 1 s under 8 streaming jobs. Every reader must end up with the
    whole text (the result's), and one result per job."""
    url, prefix, c = private
    specs = [dict(prompt=f"norepl {i}", max_tokens=120) for i in range(8)]
    jobs = c.submit_many(specs)
    with worker_thread(FakeEngine(max_num_seqs=8, step_delay=0.02), url, prefix,
                       claim_idle_ms=3000, heartbeat_s=0.2):
        wait_for(lambda: all(c.redis.xlen(c.keys.events(j.id)) >= 10 for j in jobs),
                 what="8 jobs streaming")
        with refused_writes(c.redis):
            time.sleep(1.0)
        assert refusals(c.redis, "NOREPLICAS") > 0, "nothing was refused"
        results = [j.result(timeout=30) for j in jobs]
    for spec, job, res in zip(specs, jobs, results):
        assert res.text == expected_for_prompt(spec["prompt"], 120)
    missing = {j.id: len(r.text) - len(reader_text(c, j.id)) for j, r in zip(jobs, results)
               if reader_text(c, j.id) != r.text}
    assert missing == {}, f"readers missed tokens (job: characters short): {missing}"
    assert pool_problems(c, jobs) == {}


def test_a_refused_dead_letter_leaves_its_entry_pending(private):
    """Item 1's second half, the outbox alone: an entry to dead-letter under memory pressure.
    Its XADD to the dead stream is refused; the entry must stay pending (not acknowledged, not
    deleted) until a resend lands the dead letter and the acknowledgement together."""
    from genpool.schemas import Keys
    from genpool.schemas.connection import connect
    from genpool.workers.job import Job
    from genpool.workers.outbox import Outbox
    from genpool.workers.streams import ensure_groups, entries_from

    url, prefix, c = private
    r, keys = connect(url), Keys(prefix)
    lane = keys.jobs("normal")
    ensure_groups(r, keys)
    r.xadd(lane, {"job": "not json"})
    entry, = entries_from(r.xreadgroup(keys.group, "w", {lane: ">"}), keys)
    out = Outbox(keys, "w")
    out.dead(Job(entry), "junk")
    with memory_pressure(r):
        answer = out.send(r, out.take())
        assert (r.xpending(lane, keys.group)["pending"], r.xlen(lane), r.xlen(keys.dead)) == \
            (1, 1, 0), "acknowledged without its dead letter"
    lost, refused = answer
    assert lost == set() and [op.kind for op in refused] == ["dead"]
    assert out.send(r, refused) == (set(), [])
    assert (r.xpending(lane, keys.group)["pending"], r.xlen(lane), r.xlen(keys.dead)) == (0, 0, 1)
    (_, dead), = c.redis.xrange(keys.dead)
    assert dead["reason"] == "junk" and dead["source_entry"] == entry.entry_id


def test_dead_letters_of_every_lane_shard_on_a_cluster(cluster_url):
    """A dead letter and its acknowledgement go in one script where one slot holds both (lane
    shard 0 and the dead stream share `{prefix}`); lane shard 1 is another slot: there the dead
    letter goes first, and only then the acknowledgement. Both end dead-lettered and deleted."""
    from genpool.schemas import Keys
    from genpool.schemas.connection import connect
    from genpool.workers.job import Job
    from genpool.workers.outbox import Outbox
    from genpool.workers.streams import ensure_groups, entries_from

    prefix = new_prefix("deadshards")
    r, keys = connect(cluster_url), Keys(prefix, lane_shards=2)
    try:
        ensure_groups(r, keys)
        out = Outbox(keys, "w")
        for shard in (0, 1):
            lane = keys.jobs("normal", shard)
            r.xadd(lane, {"job": f"junk {shard}"})
            entry, = entries_from(r.xreadgroup(keys.group, "w", {lane: ">"}), keys)
            out.dead(Job(entry), f"junk of shard {shard}")
        assert out.send(r, out.take()) == (set(), [])
        assert sorted(f[b"reason"] for _, f in r.xrange(keys.dead)) == [
            b"junk of shard 0", b"junk of shard 1"]
        assert [r.xlen(keys.jobs("normal", k)) for k in (0, 1)] == [0, 0]
        assert [r.xpending(keys.jobs("normal", k), keys.group)["pending"] for k in (0, 1)] == \
            [0, 0]
    finally:
        r.close()
        drop_prefix(cluster_url, prefix)
