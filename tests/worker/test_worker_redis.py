"""The worker's Redis side (real Redis, deterministic fake engine: fast, no torch)."""
from __future__ import annotations

import json
import time

import pytest

from genpool.producer import Client
from genpool.schemas import parse_event
from genpool.schemas.connection import connect
from tests.chaos_helpers import stream_problems
from tests.fake_engine import FakeEngine, expected_for_prompt, expected_text
from tests.pool_helpers import client_env, wait_for, worker_thread


@pytest.fixture
def env(topology_url):
    """One server, then a 3-master Redis Cluster (tests/conftest.py)."""
    with client_env(topology_url, "wrk") as e:
        yield e


def raw_events(c: Client, job_id: str) -> list:
    return [parse_event(f["event"]) for _, f in c.redis.xrange(c.keys.events(job_id))]


def test_jobs_stream_and_finish(env):
    url, prefix, c = env
    eng = FakeEngine(max_num_seqs=4)
    specs = [dict(prompt=f"job {i}", max_tokens=3 + i % 5, priority=i % 3 - 1) for i in range(24)]
    specs.append(dict(messages=[{"role": "user", "content": "hi"}], max_tokens=4))
    with worker_thread(eng, url, prefix):
        jobs = c.submit_many(specs)
        for spec, job in zip(specs, jobs):
            streamed = "".join(e.text for e in job.stream(timeout=10))
            res = job.result()
            if "prompt" in spec:
                want = expected_for_prompt(spec["prompt"], spec["max_tokens"])
            else:  # chat prompts are tokenized without BOS, as LLM.chat does
                ids = eng.tokenizer(eng.apply_chat_template(spec["messages"]),
                                    add_special_tokens=False)["input_ids"]
                want = expected_text(ids, spec["max_tokens"])
            assert streamed == res.text == want
            assert res.finish_reason == "length" and res.usage.completion_tokens == len(res.text)
            assert 0 <= res.timings.queued_s <= res.timings.ttft_s <= res.timings.total_s
    st = c.status()
    assert all(v == {"queued": 0, "pending": 0} for v in st["lanes"].values())
    assert c.redis.ttl(c.keys.job(jobs[0].id)) > 0 and c.redis.ttl(c.keys.events(jobs[0].id)) > 0


def test_job_id_runs_once_even_via_raw_xadd(env):
    url, prefix, c = env
    eng = FakeEngine()
    payload = json.dumps({"id": "dup", "prompt": "same", "max_tokens": 3})
    c.redis.xadd(c.keys.jobs("normal"), {"job": payload})
    c.redis.xadd(c.keys.jobs("normal"), {"job": payload})
    c.submit("same", job_id="dup", max_tokens=3)  # a third entry (raw XADDs left no hash)
    assert c.submit("same", job_id="dup", max_tokens=3).duplicate  # now the hash exists
    with worker_thread(eng, url, prefix):
        assert c.job("dup").result(timeout=10).text == expected_for_prompt("same", 3)
        wait_for(lambda: c.status()["lanes"]["normal"] == {"queued": 0, "pending": 0})
    assert eng.added == 1
    assert [e.type for e in raw_events(c, "dup")].count("result") == 1


def test_cancel_stops_within_a_step(env):
    url, prefix, c = env
    eng = FakeEngine(step_delay=0.02)
    with worker_thread(eng, url, prefix):
        job = c.submit("long one", max_tokens=2000)
        stream = job.stream(timeout=10)
        next(stream)
        job.cancel()
        t0 = time.monotonic()
        rest = list(stream)
        res = job.result()
        assert res.error.code == "cancelled" and time.monotonic() - t0 < 1.0
        assert len(rest) <= 3 and not eng.requests  # aborted in the engine: blocks freed
    assert c.job(job.id).info()["state"] == "cancelled"


def test_cancel_before_start_and_deadlines(env):
    url, prefix, c = env
    pre = c.submit("never", max_tokens=5)
    pre.cancel()
    late = c.submit("late", max_tokens=5, deadline=time.time() - 1)
    eng = FakeEngine(step_delay=0.02)
    with worker_thread(eng, url, prefix):
        assert pre.result(timeout=10).error.code == "cancelled"
        res = late.result(timeout=10, raise_on_error=False)
        assert res.error.code == "expired" and "before it started" in res.error.message
        running = c.submit("slow", max_tokens=5000, deadline=time.time() + 0.5)
        res = running.result(timeout=10, raise_on_error=False)
        assert res.error.code == "expired" and "after" in res.error.message
        assert not eng.requests
    assert eng.added == 1  # only the job whose deadline passed while running was started


def test_hostile_entries(env):
    url, prefix, c = env
    lane = c.keys.jobs("normal")
    c.redis.xadd(lane, {"junk": "x"})
    c.redis.xadd(lane, {"job": b"\xff\xfe not even json"})
    c.redis.xadd(lane, {"job": '{"id": "b1", "prompt": "x", "max_tokens": -4}'})
    c.redis.xadd(lane, {"job": '{"id": "b2", "prompt": "x", "model": "other"}'})
    c.redis.xadd(lane, {"job": '{"id": "b3", "prompt": "' + "x" * 5000 + '"}'})
    good = c.submit("fine", max_tokens=3)
    with worker_thread(FakeEngine(max_model_len=4096), url, prefix) as w:
        assert good.result(timeout=10).text == expected_for_prompt("fine", 3)
        assert c.job("b1").result(timeout=5, raise_on_error=False).error.code == "invalid_request"
        assert c.job("b2").result(timeout=5, raise_on_error=False).error.code == "unknown_model"
        err = c.job("b3").result(timeout=5, raise_on_error=False).error
        assert err.code == "invalid_request" and "prompt is 5001 tokens" in err.message
        wait_for(lambda: c.redis.xlen(c.keys.dead) == 2, what="2 dead letters")
        assert w.started and not w.stopping
    assert c.status()["dead"]["count"] == 2  # status copes with junk bytes
    dead = connect(url).xrange(c.keys.dead)
    assert any(f[b"payload"] == rb"\xff\xfe not even json" for _, f in dead)
    reasons = [f[b"reason"].decode() for _, f in dead]
    assert any("no 'job' field" in r for r in reasons)
    assert any("not valid UTF-8" in r for r in reasons)


def _ghost_take(c: Client, n_times: int = 1) -> list:
    """Deliver everything queued to a consumer that then 'dies' (never acks)."""
    from genpool.workers.streams import ensure_groups

    ensure_groups(c.redis, c.keys)
    got = c.redis.xreadgroup(c.keys.group, "ghost", {c.keys.jobs("normal"): ">"}, count=100)
    ids = [i for i, _ in got[0][1]]
    for _ in range(n_times - 1):
        c.redis.xclaim(c.keys.jobs("normal"), c.keys.group, "ghost", 0, ids)
    return ids


def test_entries_of_a_dead_worker_are_reclaimed(env):
    url, prefix, c = env
    jobs = c.submit_many([dict(prompt=f"r{i}", max_tokens=4) for i in range(5)])
    assert len(_ghost_take(c)) == 5
    with worker_thread(FakeEngine(), url, prefix, claim_idle_ms=300):
        for i, job in enumerate(jobs):
            streamed = "".join(e.text for e in job.stream(timeout=10))
            assert streamed == job.result().text == expected_for_prompt(f"r{i}", 4)
            # the ghost never started them: nothing was published, so the reader is told nothing
            types = [e.type for e in raw_events(c, job.id)]
            assert types[0] == "token" and not {"restart", "resume"} & set(types)


def test_a_dead_workers_jobs_go_before_the_backlog(env):
    """A full worker with a long backlog must still take over a dead peer's jobs at its next free
    slot: they have waited longest. (It used to reclaim only when its periodic upkeep happened
    to find a free slot, which the lanes refill after every step, so orphans waited behind the
    whole backlog; the chaos suite's SIGSTOP scenario saw 2 of 16 jobs taken over.)"""
    url, prefix, c = env
    orphans = c.submit_many([dict(prompt=f"o{i}", max_tokens=10) for i in range(4)])
    assert len(_ghost_take(c)) == 4
    backlog = c.submit_many([dict(prompt=f"b{i}", max_tokens=10) for i in range(80)])
    with worker_thread(FakeEngine(max_num_seqs=2, step_delay=0.01), url, prefix,
                       claim_idle_ms=300, heartbeat_s=1.0):
        for job in orphans + backlog:
            assert job.result(timeout=60).ok
    # by the jobs' own finish times (the worker's clock): counted after the last orphan's
    # result came back, the backlog kept finishing meanwhile (80 reads on a busy CI machine)
    last = max(float(c.job(j.id).info()["finished_at"]) for j in orphans)
    done = sum(float(c.job(j.id).info()["finished_at"]) < last for j in backlog)
    # 300 ms claim window at ~10 backlog jobs/s, then the next 2 free slots, twice
    assert done <= 15, f"{done} backlog jobs finished before the dead worker's 4"


def test_a_connection_lost_mid_admission_loses_no_job(env):
    """Redis goes away while the worker checks ownership of the entries it just read (the
    cluster-restart run saw it: 'cluster is down' inside the claim pipeline). Those entries
    must become reclaimable; they used to stay held (their idle time kept fresh) and wait
    forever. The lease thread must not take a failed renewal for a lost lease either."""
    import redis

    url, prefix, c = env
    jobs = c.submit_many([dict(prompt=f"m{i}", max_tokens=5) for i in range(3)])
    with worker_thread(FakeEngine(), url, prefix, claim_idle_ms=300, heartbeat_s=0.1) as w:
        real, calls = w.admission.admitter.claim, []

        def flaky(parsed):
            calls.append(len(parsed))
            if len(calls) == 1:
                real(parsed)  # the claims land; the replies never arrive
                raise redis.ConnectionError("connection lost mid-admission (injected)")
            return real(parsed)

        w.admission.admitter.claim = flaky
        for i, job in enumerate(jobs):
            assert job.result(timeout=15).text == expected_for_prompt(f"m{i}", 5)
    assert calls[0] == 3 and w.counts["lost"] == 0 and w.counts["reconnects"] >= 1


def test_a_connection_lost_at_the_solo_mark_strands_no_job(env, monkeypatch):
    """A suspect job (it shared two lost workers' batches) is marked 'solo' before it runs
    alone; Redis lost at that call used to leave it in no queue while its lease was renewed
    and its entry kept fresh: never run, never reclaimed (found by a hostile outage run)."""
    import redis

    from genpool.workers.lease import LeaseKeeper

    url, prefix, c = env
    real, hit = LeaseKeeper.call, []

    def call(self, job_id, token, op, *args):
        if op == "solo" and not hit:
            hit.append(job_id)
            raise redis.ConnectionError("connection lost at the solo mark (injected)")
        return real(self, job_id, token, op, *args)

    monkeypatch.setattr(LeaseKeeper, "call", call)
    job = c.submit("solo job", max_tokens=6, job_id="sus-1")
    c.redis.hset(c.keys.job("sus-1"), "suspect", 2)
    other = c.submit("plain job", max_tokens=6)
    with worker_thread(FakeEngine(), url, prefix, claim_idle_ms=1000, heartbeat_s=0.2):
        assert other.result(timeout=10).ok
        assert job.result(timeout=10).text == expected_for_prompt("solo job", 6)
    assert hit == ["sus-1"]


def test_a_reply_lost_while_draining_duplicates_no_tokens(env, monkeypatch):
    """A token batch lands but its reply is lost, the job finishes in the next step, and the
    worker is draining with nothing left in flight: the resend must come as a restart and a
    replay (readers' text equals the result), not as the same tokens a second time."""
    import redis

    from genpool.workers.outbox import Outbox

    url, prefix, c = env
    real, sent = Outbox.send, []

    def send(self, r, ops):
        out = real(self, r, ops)
        sent.extend(ev for op in ops for ev in op.events if '"type":"token"' in ev)
        if len(sent) == 4 and not getattr(self, "_failed_once", False):  # tokens 1-4 landed,
            self._failed_once = True  # the reply never arrives; token 5 ends the job
            raise redis.ConnectionError("reply lost (injected)")
        return out

    monkeypatch.setattr(Outbox, "send", send)
    job = c.submit("drain me", max_tokens=5)
    with worker_thread(FakeEngine(step_delay=0.05), url, prefix) as w:
        wait_for(lambda: job.id in w.jobs.running, what="running")
        w.stop(drain_timeout_s=10)
    text = "".join(e.text for e in job.stream(timeout=10))
    assert text == job.result().text == expected_for_prompt("drain me", 5)


def test_an_error_reply_to_a_renewal_is_no_lost_lease():
    """Only the fence script's own 0 means another worker took a job over (the cluster-restart
    run saw 8 leases dropped as 'lost' while the cluster was down); an error in its place says
    nothing about the lease."""
    import redis

    from genpool.workers.lease import lease_outcomes

    errors = [redis.exceptions.ClusterDownError("The cluster is down"),
              redis.exceptions.TryAgainError("TRYAGAIN"),
              redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind")]
    assert lease_outcomes([1, 0, *errors]) == [True, False, None, None, None]


def test_a_clobbered_job_hash_stops_neither_renewals_nor_heartbeats(env):
    """One job's hash overwritten by a string (WRONGTYPE on its renewal) must not stop the
    renewal of the others, the refresh of held entries or the heartbeat: else every job of
    this worker goes idle and its peers take them over."""
    url, prefix, c = env
    good, bad = (c.submit(f"long {i}", max_tokens=400) for i in range(2))
    # refreshed every 0.1 s: a stopped refresh leaves the entries 2.5 s idle, while the bound
    # (the claim window) leaves room for a loaded CI machine's stall (one of 0.7 s was seen).
    # Two slots, both taken: with a free one the worker would reclaim its own idle entries,
    # which resets their idle time and hid a stopped refresh from this test
    with worker_thread(FakeEngine(step_delay=0.02, max_num_seqs=2), url, prefix,
                       claim_idle_ms=1000, heartbeat_s=0.1) as w:
        wait_for(lambda: {good.id, bad.id} <= set(w.jobs.running), what="both running")
        key = c.keys.job(bad.id)
        ttl = c.redis.pttl(key)
        c.redis.set(key, "clobbered", px=max(ttl, 60_000))
        time.sleep(2.5)  # 2.5 x the claim window
        idle = {p["message_id"].decode() if isinstance(p["message_id"], bytes)
                else p["message_id"]: p["time_since_delivered"]
                for p in c.redis.xpending_range(c.keys.jobs("normal"), c.keys.group, "-", "+", 10)}
        beat = json.loads(c.redis.hget(c.keys.workers, w.name))
        assert good.id in w.jobs.running and w.counts["lost"] == 0
        assert idle and max(idle.values()) < 1000, idle  # still refreshed: nobody may take them
        assert time.time() - beat["beat"] < 1.0  # the heartbeat still beats
        assert good.result(timeout=30).ok


def test_a_clobbered_job_hash_fails_that_job_alone(env):
    """A job whose hash a client overwrote (WRONGTYPE on its ownership claim) is dead-lettered
    alone; the jobs claimed in the same pipeline run (they used to fail with it, every time
    they were reclaimed, with a growing suspect count)."""
    url, prefix, c = env
    jobs = c.submit_many([dict(prompt=f"p{i}", max_tokens=3) for i in range(4)])
    c.redis.set(c.keys.job(jobs[0].id), "clobbered", ex=600)
    with worker_thread(FakeEngine(max_num_seqs=8), url, prefix, claim_idle_ms=300,
                       heartbeat_s=0.1) as w:
        for i, job in enumerate(jobs[1:], 1):
            assert job.result(timeout=10).text == expected_for_prompt(f"p{i}", 3)
        wait_for(lambda: c.redis.xlen(c.keys.dead) == 1, what="1 dead letter")
        assert w.counts["done"] == 3
    (_, dead), = c.redis.xrange(c.keys.dead)
    assert "cannot be claimed" in dead["reason"] and jobs[0].id in dead["payload"]
    assert all(c.job(j.id).info().get("suspect", "0") == "0" for j in jobs[1:])
    assert c.status()["lanes"]["normal"] == {"queued": 0, "pending": 0}


def test_reclaim_finds_an_idle_entry_behind_a_long_pending_list(env):
    """A full worker asks for one or two entries; the dead peer's entry may sit behind
    hundreds of live ones in the pending list (one XAUTOCLAIM scans only 10 x count)."""
    from genpool.workers.streams import ensure_groups, reclaim

    url, prefix, c = env
    ensure_groups(c.redis, c.keys)
    lane = c.keys.jobs("normal")
    c.submit_many([dict(prompt=f"live {i}", max_tokens=2) for i in range(200)])
    orphan = c.submit("orphan", max_tokens=2)  # the newest entry: last in the pending list
    ids = [i for i, _ in c.redis.xreadgroup(c.keys.group, "dead-peer", {lane: ">"})[0][1]]
    time.sleep(1.2)
    c.redis.xclaim(lane, c.keys.group, "live-peer", 0, ids[:200], justid=True)  # fresh again
    # a 1 s window: the live entries must stay under it until the probe, which a stall of
    # this thread on CI (0.7 s seen) could have pushed them past with the 300 ms of before
    got = reclaim(c.redis, c.keys, "me", 1000, 1)
    assert [json.loads(e.fields["job"])["id"] for e in got] == [orphan.id]
    assert got[0].deliveries == 2


def test_too_many_deliveries_go_to_the_dead_stream(env):
    url, prefix, c = env
    job = c.submit("poison", max_tokens=4)
    _ghost_take(c, n_times=3)  # delivered 3 times; the reclaim makes it 4 > max 3
    with worker_thread(FakeEngine(), url, prefix, claim_idle_ms=200, max_deliveries=3):
        err = job.result(timeout=10, raise_on_error=False).error
        assert err.code == "dead_lettered" and "delivered 4 times" in err.message
    (_, dead), = c.redis.xrange(c.keys.dead)
    assert dead["job_id"] == job.id and json.loads(dead["payload"])["id"] == job.id
    assert c.status()["lanes"]["normal"] == {"queued": 0, "pending": 0}


def test_long_jobs_are_not_stolen_from_a_live_worker(env):
    url, prefix, c = env
    job = c.submit("long", max_tokens=60)
    with worker_thread(FakeEngine(step_delay=0.03), url, prefix, claim_idle_ms=300):
        wait_for(lambda: c.redis.exists(c.keys.events(job.id)), what="first token")
        with worker_thread(FakeEngine(), url, prefix, claim_idle_ms=300):
            assert job.result(timeout=20).text == expected_for_prompt("long", 60)
    assert "restart" not in [e.type for e in raw_events(c, job.id)]


def test_sigterm_drain_finishes_in_flight(env):
    url, prefix, c = env
    eng = FakeEngine(step_delay=0.02)
    with worker_thread(eng, url, prefix, drain_timeout_s=10) as w:
        jobs = c.submit_many([dict(prompt=f"d{i}", max_tokens=30) for i in range(3)])
        wait_for(lambda: len(w.jobs.running) == 3, what="3 in flight")
        w.stop()
        # A poll already in flight when stop() lands may still take one entry; submit only after
        # the worker has gone through two more ticks, so the pull is known to be switched off.
        steps = w.steps
        wait_for(lambda: w.steps >= steps + 2 or not w.jobs.running, what="two ticks after stop")
        queued_later = c.submit("after stop", max_tokens=3)
    assert all(j.result(timeout=1).text == expected_for_prompt(f"d{i}", 30)
               for i, j in enumerate(jobs))
    assert c.status()["lanes"]["normal"] == {"queued": 1, "pending": 0}  # left for others
    assert not c.status()["workers"]  # said goodbye
    assert queued_later.info()["state"] == "queued"


def test_drain_timeout_releases_the_rest(env):
    url, prefix, c = env
    job = c.submit("unfinished", max_tokens=80)
    with worker_thread(FakeEngine(step_delay=0.02), url, prefix, drain_timeout_s=0.3) as w:
        wait_for(lambda: c.redis.exists(c.keys.events(job.id)), what="first token")
    assert c.status()["lanes"]["normal"]["pending"] == 1 and w.counts["done"] == 0
    # the release marked the entry long idle: a peer takes it at its next reclaim check, not
    # after its (here 10-minute) claim window
    t0 = time.monotonic()
    with worker_thread(FakeEngine(), url, prefix, claim_idle_ms=600_000, heartbeat_s=0.2):
        text = "".join(e.text for e in job.stream(timeout=10))
    assert time.monotonic() - t0 < 10
    assert text == job.result().text == expected_for_prompt("unfinished", 80)
    assert stream_problems(c, job.id) == []  # one attempt after the other; the resume adds up
    types = [e.type for e in raw_events(c, job.id)]
    assert types.count("resume") == 1 and "restart" not in types
    res = job.result()
    assert res.usage.completion_tokens == 80 and len(res.token_ids) == 80


def test_high_lane_overtakes_a_full_engine(env):
    url, prefix, c = env
    eng = FakeEngine(max_num_seqs=2, step_delay=0.01)
    with worker_thread(eng, url, prefix) as w:
        bulk = c.submit_many([dict(prompt=f"b{i}", max_tokens=40, priority=5) for i in range(20)])
        wait_for(lambda: len(w.jobs.running) == 2, what="engine full")
        vip = c.submit("vip", max_tokens=5, priority=-1)
        res = vip.result(timeout=10)
        # arrival mid-step k -> read before step k+1 -> first token from step k+1: 2 steps
        # (3 allowed: entry ids have millisecond resolution)
        assert res.timings.ttft_steps is not None and 1 <= res.timings.ttft_steps <= 3
        assert len(w.jobs.running) <= 2 + w.cfg.high_burst
        done_before = sum(c.job(j.id).info().get("state") == "done" for j in bulk)
        assert done_before <= 2
        for j in bulk:
            j.stop_waiting = j.result(timeout=30)


def test_lane_streams_deleted_under_a_running_worker(env):
    url, prefix, c = env
    with worker_thread(FakeEngine(), url, prefix):
        assert c.submit("a", max_tokens=2).result(timeout=10).ok
        c.redis.delete(*c.keys.all_jobs())  # groups gone: the worker gets NOGROUP
        time.sleep(0.5)
        assert c.submit("b", max_tokens=2).result(timeout=10).text == expected_for_prompt("b", 2)


def test_sigterm_on_a_worker_process_drains(env, tmp_path):
    import signal

    from tests.pool_helpers import spawn_worker, workers_alive

    url, prefix, c = env
    proc = spawn_worker(url, prefix, "fake", "sig", "--engine-factory", "tests.fake_engine:make",
                        "--max-num-seqs", "4", "--drain-timeout", "20",
                        env={"GENPOOL_FAKE_STEP_DELAY": "0.02"}, log_path=tmp_path / "w.log")
    try:
        wait_for(lambda: workers_alive(url, prefix) == 1, timeout=60, what="worker up")
        jobs = c.submit_many([dict(prompt=f"s{i}", max_tokens=40) for i in range(10)])
        wait_for(lambda: c.status()["lanes"]["normal"]["pending"] == 4, what="4 in flight")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    states = [c.job(j.id).info()["state"] for j in jobs]
    assert states.count("done") >= 4 and states.count("queued") >= 1  # in flight finished
    assert c.status()["lanes"]["normal"]["pending"] == 0  # nothing left half-done
    assert "draining" in (tmp_path / "w.log").read_text()


def test_worker_reloads_its_read_script_after_redis_forgets_it(env):
    """poll() calls READ_LUA by EVALSHA inside a pipeline; a Redis restart or SCRIPT FLUSH must
    not stop the worker from pulling jobs."""
    url, prefix, c = env
    with worker_thread(FakeEngine(), url, prefix):
        long = c.submit("long", max_tokens=200)  # keeps the worker stepping (non-idle poll path)
        assert c.submit("a", max_tokens=2).result(timeout=10).ok
        c.redis.script_flush()
        assert c.submit("b", max_tokens=2).result(timeout=10).text == expected_for_prompt("b", 2)
        assert long.result(timeout=30).ok
