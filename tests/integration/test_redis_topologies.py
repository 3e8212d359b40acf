"""Redis Cluster and Sentinel: URLs, lane shards, per-node pipelines, a Sentinel failover.

Real servers on loopback (tests/redis_topologies.py); the fake engine keeps it fast and exact.
"""
from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from genpool.producer import Client
from genpool.schemas import Keys, parse_event
from genpool.schemas.connection import connect, is_cluster, mask, parse
from genpool.workers.streams import lane_budgets, publish_shards
from tests.fake_engine import FakeEngine, expected_for_prompt
from tests.pool_helpers import drop_prefix, new_prefix, wait_for, worker_thread


def test_url_forms():
    t = parse("redis+cluster://a:7000,b:7001")
    assert (t.kind, t.nodes, t.tls) == ("cluster", (("a", 7000), ("b", 7001)), False)
    assert parse("rediss+cluster://u:pw@a:7000").tls and parse("rediss+cluster://u:pw@a:7000"
                                                               ).password == "pw"
    t = parse("redis+sentinel://:secret@s1:26379,s2:26380/mymaster/3?sentinel_password=sp")
    assert (t.kind, t.service, t.db, t.password, t.sentinel_password) == \
        ("sentinel", "mymaster", 3, "secret", "sp")
    assert parse("redis+sentinel://s1:26379/mymaster").db == 0
    assert parse("redis://h:1/2").kind == "single" and parse("unix:///tmp/r.sock").kind == "single"
    with pytest.raises(ValueError, match="service_name"):
        parse("redis+sentinel://s1:26379")
    with pytest.raises(ValueError, match="bad host:port"):
        parse("redis+cluster://nohostport")
    with pytest.raises(ValueError, match="only database 0"):
        parse("redis+cluster://a:7000/3")
    assert mask("redis+sentinel://:secret@s1:1/m") == "redis+sentinel://:***@s1:1/m"


def test_lane_budgets_split_and_rotate():
    for shards, high, free in [(1, 5, 3), (4, 1, 0), (4, 6, 9), (3, 0, 2)]:
        for turn in range(6):
            got = lane_budgets(shards, high, free, turn)
            assert sum(h for _, h, _ in got) == high and sum(f for _, _, f in got) == free
            assert len({s for s, _, _ in got}) == len(got)
    # one free slot: every shard gets it in turn, so none waits more than `shards` steps
    assert {lane_budgets(4, 0, 1, turn)[0][0] for turn in range(4)} == {0, 1, 2, 3}


def test_cluster_pipeline_sends_one_batch_per_node(cluster_url, monkeypatch):
    """A step's events for many jobs (many slots) go out as one write per node, not per job."""
    import redis.connection

    r = connect(cluster_url)
    assert is_cluster(r)
    keys, writes = Keys(new_prefix("grp")), Counter()
    job_ids = [f"j{i}" for i in range(300)]

    def step():
        pipe = r.pipeline(transaction=False)
        for jid in job_ids:
            pipe.xadd(keys.events(jid), {"event": "{}"})
            pipe.expire(keys.events(jid), 60)
        pipe.execute()

    step()  # opens a connection to every node (its handshake is several writes)
    original = redis.connection.AbstractConnection.send_packed_command

    def counted(self, command, check_health=True):
        writes[(self.host, self.port)] += 1
        return original(self, command, check_health)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counted)
    step()
    monkeypatch.undo()
    assert len(writes) == 3 and all(n == 1 for n in writes.values()), writes
    assert sum(r.xlen(keys.events(j)) for j in job_ids) == 600
    r.delete(*[keys.events(j) for j in job_ids])


def test_lane_shards_spread_intake_and_workers_read_them_all(topology_url):
    url, prefix = topology_url, new_prefix("shard")
    r = connect(url)
    try:
        assert publish_shards(r, Keys(prefix, 4)).lane_shards == 4
        assert publish_shards(r, Keys(prefix, 2)).lane_shards == 4  # never lowered
        c = Client(url, prefix)
        specs = [dict(prompt=f"sharded {i}", max_tokens=3, priority=i % 3 - 1) for i in range(40)]
        jobs = c.submit_many(specs) + [c.submit("one more", max_tokens=2)]
        assert c.keys.lane_shards == 4
        per_shard = [sum(r.xlen(k) for k in c.keys.shard_lanes(s)) for s in range(4)]
        assert sum(per_shard) == 41 and min(per_shard) > 0, per_shard
        # a worker told 1 shard still reads all 4: it adopts the deployment's count
        with worker_thread(FakeEngine(max_num_seqs=4), url, prefix, lane_shards=1):
            for spec, job in zip(specs, jobs):
                assert job.result(timeout=20).text == expected_for_prompt(spec["prompt"], 3)
            assert jobs[-1].result(timeout=20).text == expected_for_prompt("one more", 2)
            wait_for(lambda: all(v == {"queued": 0, "pending": 0}
                                 for v in c.status()["lanes"].values()), what="lanes drained")
        c.close()
    finally:
        drop_prefix(url, prefix)


def _collect(c: Client, jobs, out: dict, timeout: float = 120) -> None:
    for job in jobs:
        text = "".join(e.text for e in job.stream(timeout=timeout))
        out[job.id] = (text, job.result())


def test_sentinel_failover_mid_run_every_job_one_result(redis_sentinel):
    """Kill the master while two workers are mid-run: the sentinels promote the replica, the
    workers and readers follow it, and every job ends with exactly one result, with the right
    text."""
    url, prefix = redis_sentinel.url, new_prefix("sent")
    c = Client(url, prefix)
    specs = [dict(prompt=f"failover {i}", max_tokens=60, job_id=f"f{i:03d}") for i in range(40)]
    got: dict = {}
    with worker_thread(FakeEngine(max_num_seqs=8, step_delay=0.02), url, prefix,
                       claim_idle_ms=3000, heartbeat_s=0.5) as w1, \
            worker_thread(FakeEngine(max_num_seqs=8, step_delay=0.02), url, prefix,
                          claim_idle_ms=3000, heartbeat_s=0.5) as w2:
        jobs = c.submit_many(specs)
        c.redis.execute_command("WAIT", 1, 5000)  # the submits are on the replica too
        readers = [threading.Thread(target=_collect, args=(c, jobs[k::4], got)) for k in range(4)]
        for t in readers:
            t.start()
        wait_for(lambda: sum(c.job(j.id).info().get("state") == "running" for j in jobs) >= 10,
                 timeout=30, interval=0.01, what="jobs running")
        unfinished = sum(c.job(j.id).info().get("state") != "done" for j in jobs)
        old = redis_sentinel.kill_master()
        new = redis_sentinel.wait_failover(old)
        for t in readers:
            t.join(180)
    assert new != old and len(got) == len(specs)
    assert unfinished >= 20  # the failover hit a run in progress
    assert w1.counts["reconnects"] >= 1 and w2.counts["reconnects"] >= 1  # both followed it
    for spec in specs:
        text, res = got[spec["job_id"]]
        want = expected_for_prompt(spec["prompt"], spec["max_tokens"])
        assert res.error is None and text == res.text == want, spec["job_id"]
        events = [parse_event(f["event"]).type
                  for _, f in c.redis.xrange(c.keys.events(spec["job_id"]))]
        assert events.count("result") == 1 and "error" not in events, (spec["job_id"], events)
        assert c.job(spec["job_id"]).info()["state"] == "done"
    c.close()


def test_celery_settings_for_each_topology(monkeypatch):
    from genpool.workers.integrations.celery_app import ENV_BROKER, celery_redis

    monkeypatch.delenv(ENV_BROKER, raising=False)
    assert celery_redis("redis://h:1/2") == {"broker_url": "redis://h:1/2",
                                            "result_backend": "redis://h:1/2"}
    conf = celery_redis("redis+sentinel://:pw@s1:1,s2:2/gp/3")
    assert conf["broker_url"] == "sentinel://:pw@s1:1/3;sentinel://:pw@s2:2/3"
    assert conf["broker_transport_options"]["master_name"] == "gp"
    assert conf["result_backend_transport_options"]["master_name"] == "gp"
    with pytest.raises(ValueError, match=ENV_BROKER):
        celery_redis("redis+cluster://a:1")
    monkeypatch.setenv(ENV_BROKER, "redis://b:6379/1")
    assert celery_redis("redis+cluster://a:1")["broker_url"] == "redis://b:6379/1"


def test_celery_reaches_the_master_through_sentinel(redis_sentinel):
    """kombu, configured by celery_redis(), finds the master through the sentinels."""
    from genpool.workers.integrations.celery_app import make_app

    app = make_app(redis_sentinel.url, queue=new_prefix("q"))
    with app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=3)
        q = conn.SimpleQueue(new_prefix("kombu"))
        q.put({"hello": "sentinel"})
        assert q.get(timeout=5).payload == {"hello": "sentinel"}
        q.clear()
        q.close()


def test_every_front_door_through_sentinel(redis_sentinel, tmp_path):
    """Client, AsyncClient, the gateway and the batch runner, all given only the Sentinel URL,
    reach the master the sentinels name."""
    import asyncio
    import json

    import openai

    from genpool.producer import AsyncClient
    from genpool.producer.batch import run_batch
    from genpool.producer.gateway import create_app
    from tests.producer.test_gateway import serve_in_thread

    url, prefix = redis_sentinel.url, new_prefix("front")
    c = Client(url, prefix)
    with worker_thread(FakeEngine(max_num_seqs=8), url, prefix, served_models=frozenset({"sim"})):
        assert c.submit("sync", max_tokens=3).result(timeout=20).text == \
            expected_for_prompt("sync", 3)

        async def via_async():
            async with AsyncClient(url, prefix) as ac:
                return (await (await ac.submit("async", max_tokens=4)).result(timeout=20)).text

        assert asyncio.run(via_async()) == expected_for_prompt("async", 4)
        with serve_in_thread(create_app(url, prefix)) as base:
            oa = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
            out = oa.completions.create(model="sim", prompt="gateway", max_tokens=5)
            assert out.choices[0].text == expected_for_prompt("gateway", 5)
        inp, outp = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        inp.write_text("".join(json.dumps({"custom_id": f"b{i}", "method": "POST",
                                           "url": "/v1/completions",
                                           "body": {"model": "sim", "prompt": f"batch {i}",
                                                    "max_tokens": 2}}) + "\n" for i in range(5)))
        run_batch(inp, outp, client=c, progress=False)
        rows = [json.loads(line) for line in outp.read_text().splitlines()]
        assert sorted(r["custom_id"] for r in rows) == [f"b{i}" for i in range(5)]
        assert all(r["response"]["body"]["choices"][0]["text"] ==
                   expected_for_prompt(f"batch {r['custom_id'][1:]}", 2) for r in rows)
    c.close()


def test_dead_commands_on_each_topology(topology_url):
    """`genpool dead list/retry/purge` on one server and on a cluster, where the dead stream
    (`{prefix}` slot), the job's keys (`{id}` slot) and the lane are in different slots. A retry
    that is interrupted and run again enqueues the job once."""
    from tests.producer.test_ux import genpool

    url, prefix = topology_url, new_prefix("dead")
    c = Client(url, prefix)
    conn = ["--redis", url, "--prefix", prefix]
    try:
        # a job delivered too often (max_deliveries=0 dead-letters it at once) and a junk entry
        jobs = [c.submit(f"retry me {i}", max_tokens=3) for i in range(3)]
        c.redis.xadd(c.keys.jobs("normal"), {"junk": "x"})
        with worker_thread(FakeEngine(), url, prefix, max_deliveries=0):
            wait_for(lambda: c.redis.xlen(c.keys.dead) == 4, what="four dead letters")
        assert all(c.job(j.id).info()["state"] == "dead" for j in jobs)
        ls = genpool("dead", "list", *conn)
        assert ls.returncode == 0 and all(f"job={j.id}" in ls.stdout for j in jobs), ls.stderr
        assert "4 shown of 4" in ls.stderr
        retry = genpool("dead", "retry", "--all", *conn)
        assert retry.returncode == 1 and "Traceback" not in retry.stderr, retry.stderr[-800:]
        assert all(f"job {j.id} queued again" in retry.stdout for j in jobs), retry.stdout + retry.stderr
        assert "not a valid job" in retry.stderr and "Traceback" not in retry.stderr
        assert c.redis.xlen(c.keys.dead) == 1  # only the junk entry is left
        assert sum(c.redis.xlen(k) for k in c.lane_keys().all_jobs()) == 3  # once each
        with worker_thread(FakeEngine(), url, prefix):
            for i, j in enumerate(jobs):
                assert c.job(j.id).result(timeout=20).text == \
                    expected_for_prompt(f"retry me {i}", 3)
        for j in jobs:
            events = [parse_event(f["event"]).type for _, f in c.redis.xrange(c.keys.events(j.id))]
            assert events.count("result") == 1 and "error" not in events, events
            assert c.redis.ttl(c.keys.job(j.id)) > 0 and c.redis.ttl(c.keys.events(j.id)) > 0
        assert genpool("dead", "purge", "--all", *conn).returncode == 0
        assert c.redis.xlen(c.keys.dead) == 0
        assert genpool("dead", "purge", *conn).returncode == 2  # neither ids nor --all
    finally:
        c.close()
        drop_prefix(url, prefix)


def test_cluster_dead_retry_cut_off_before_the_xdel_runs_again_once(cluster_url, monkeypatch):
    """A cluster retry is one-slot steps with the dead letter deleted last: one cut off there and
    run again deletes the letter without enqueueing the job a second time."""
    from genpool.producer.dead import retry_dead

    url, prefix = cluster_url, new_prefix("deadcut")
    c = Client(url, prefix)
    try:
        job = c.submit("cut off", max_tokens=3)
        with worker_thread(FakeEngine(), url, prefix, max_deliveries=0):
            wait_for(lambda: c.redis.xlen(c.keys.dead) == 1, what="a dead letter")
        (entry, _), = c.redis.xrange(c.keys.dead)

        def crash(*a, **k):
            raise RuntimeError("killed before the XDEL")

        monkeypatch.setattr(c.redis, "xdel", crash)
        with pytest.raises(RuntimeError, match="killed"):
            retry_dead(c, None)
        monkeypatch.undo()
        lanes = lambda: sum(c.redis.xlen(k) for k in c.lane_keys().all_jobs())  # noqa: E731
        assert lanes() == 1 and c.redis.xlen(c.keys.dead) == 1
        assert c.job(job.id).info()["retry_of"] == entry
        assert retry_dead(c, None) == ([(entry, job.id)], [])
        assert lanes() == 1 and c.redis.xlen(c.keys.dead) == 0
        with worker_thread(FakeEngine(), url, prefix):
            assert c.job(job.id).result(timeout=20).text == expected_for_prompt("cut off", 3)
        events = [parse_event(f["event"]).type for _, f in c.redis.xrange(c.keys.events(job.id))]
        assert events.count("result") == 1 and "error" not in events, events
    finally:
        c.close()
        drop_prefix(url, prefix)


def _terminals(c: Client, job_id: str) -> list[str]:
    """Every terminal event type in a job's stored event stream."""
    from genpool.schemas import TERMINAL

    return [t for t in (parse_event(f["event"]).type for _, f in
                        c.redis.xrange(c.keys.events(job_id))) if t in TERMINAL]


def _each_got_its_text_and_one_result(c, specs, got) -> None:
    """Every reader got its job's exact text, and each job's stream holds one `result`."""
    for spec in specs:
        text, res = got[spec["job_id"]]
        want = expected_for_prompt(spec["prompt"], spec["max_tokens"])
        assert res.error is None and text == res.text == want, spec["job_id"]
        assert _terminals(c, spec["job_id"]) == ["result"], spec["job_id"]


def test_sentinel_failover_async_readers_stream_through_it(redis_sentinel):
    """AsyncClient readers stream every job across a master kill: each one sees its full text
    once and ends on one terminal event, which is the only one its stream holds."""
    import asyncio

    from genpool.producer import AsyncClient

    url, prefix = redis_sentinel.url, new_prefix("asent")
    c = Client(url, prefix)
    specs = [dict(prompt=f"async failover {i}", max_tokens=60, job_id=f"a{i:03d}")
             for i in range(16)]
    got: dict = {}
    streamed: dict = {}  # tokens each reader has seen so far

    async def read_all():
        async with AsyncClient(url, prefix) as ac:
            async def one(spec):
                job, seen = ac.job(spec["job_id"]), []
                async for ev in job.stream(timeout=45):
                    seen.append(ev.text)
                    streamed[spec["job_id"]] = len(seen)
                got[spec["job_id"]] = ("".join(seen), await job.result(timeout=5))
            await asyncio.gather(*(one(s) for s in specs))

    with worker_thread(FakeEngine(max_num_seqs=8, step_delay=0.02), url, prefix,
                       claim_idle_ms=3000, heartbeat_s=0.5) as w1, \
            worker_thread(FakeEngine(max_num_seqs=8, step_delay=0.02), url, prefix,
                          claim_idle_ms=3000, heartbeat_s=0.5):
        jobs = c.submit_many(specs)
        c.redis.execute_command("WAIT", 1, 5000)  # the submits are on the replica too
        reader = threading.Thread(target=lambda: asyncio.run(read_all()))
        reader.start()
        wait_for(lambda: sum(c.job(j.id).info().get("state") == "running" for j in jobs) >= 8
                 and len(streamed) >= 2, timeout=30, interval=0.01,
                 what="jobs running and async readers receiving tokens")
        unfinished = sum(c.job(j.id).info().get("state") != "done" for j in jobs)
        mid_stream = sum(n > 0 and jid not in got for jid, n in list(streamed.items()))
        old = redis_sentinel.kill_master()
        new = redis_sentinel.wait_failover(old)
        reader.join(50)
        assert not reader.is_alive(), "async readers did not finish after the failover"
    assert new != old and unfinished >= 8 and len(got) == len(specs)
    assert mid_stream >= 1  # readers were part-way through their streams at the kill
    assert w1.counts["reconnects"] >= 1
    _each_got_its_text_and_one_result(c, specs, got)
    c.close()


def test_sentinel_failover_batch_runner_finishes_its_file(redis_sentinel, tmp_path):
    """`genpool batch` (run_batch) keeps polling and submitting through a master kill and writes
    every line of its file exactly once, each with the right text."""
    import json

    from genpool.producer.batch import run_batch

    url, prefix = redis_sentinel.url, new_prefix("bsent")
    c = Client(url, prefix)
    n = 40
    inp, outp = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"custom_id": f"b{i}", "method": "POST",
                                       "url": "/v1/completions",
                                       "body": {"model": "fake", "prompt": f"batch {i}",
                                                "max_tokens": 30}}) + "\n" for i in range(n)))
    counts: dict = {}
    with worker_thread(FakeEngine(max_num_seqs=8, step_delay=0.02), url, prefix,
                       claim_idle_ms=3000, heartbeat_s=0.5) as w1:
        runner = threading.Thread(target=lambda: counts.update(vars(run_batch(
            inp, outp, client=c, progress=False, max_in_flight=16))))
        runner.start()
        wait_for(lambda: outp.exists() and len(outp.read_text().splitlines()) >= 5,
                 timeout=30, interval=0.01, what="the first batch lines")
        written = len(outp.read_text().splitlines())
        old = redis_sentinel.kill_master()
        new = redis_sentinel.wait_failover(old)
        runner.join(50)
        assert not runner.is_alive(), "the batch runner did not finish after the failover"
    assert new != old and written < n and w1.counts["reconnects"] >= 1
    rows = [json.loads(line) for line in outp.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in rows) == sorted(f"b{i}" for i in range(n))
    for r in rows:
        assert r["error"] is None, r
        assert r["response"]["body"]["choices"][0]["text"] == \
            expected_for_prompt(f"batch {r['custom_id'][1:]}", 30)
    assert counts["ok"] == n and counts["errors"] == 0
    for r in rows:
        assert _terminals(c, r["response"]["request_id"]) == ["result"], r["custom_id"]
    c.close()


def test_cluster_restart_mid_run_every_job_one_result():
    """The cluster variant of test_pool_e2e's Redis restart: every node of a private 3-master
    cluster (append-only, fsync always) goes down mid-run and comes back on its own data. The
    worker and the readers ride through it, and every job ends with one result, right text.
    (Entries held across a claim pipeline that failed used to wait forever: the lease thread
    kept them fresh; tests/worker's mid-admission test reproduces it.)"""
    from tests.redis_topologies import TopologyUnavailable, start_cluster

    try:
        cluster = start_cluster(masters=3, replicas=0, persist=True)
    except (TopologyUnavailable, OSError) as e:
        pytest.skip(f"Redis Cluster cannot start here: {e}")
    url, prefix = cluster.url, new_prefix("crst")
    try:
        c = Client(url, prefix)
        specs = [dict(prompt=f"restart {i}", max_tokens=80, job_id=f"r{i:03d}") for i in range(24)]
        got: dict = {}
        with worker_thread(FakeEngine(max_num_seqs=8, step_delay=0.02), url, prefix,
                           claim_idle_ms=3000, heartbeat_s=0.5) as w:
            jobs = c.submit_many(specs)
            readers = [threading.Thread(target=_collect, args=(c, jobs[k::4], got, 40))
                       for k in range(4)]
            for t in readers:
                t.start()
            wait_for(lambda: sum(c.job(j.id).info().get("state") == "running" for j in jobs)
                     >= 8, timeout=30, interval=0.01, what="jobs running")
            unfinished = sum(c.job(j.id).info().get("state") != "done" for j in jobs)
            cluster.shutdown()
            time.sleep(2.0)
            cluster.restart()
            for t in readers:
                t.join(50)
            assert not any(t.is_alive() for t in readers), "readers did not finish"
        assert unfinished >= 16 and len(got) == len(specs)
        # the lone worker lost no job to a "peer" (a failed renewal once read as a lost lease)
        assert w.counts["reconnects"] >= 1 and w.counts["lost"] == 0
        _each_got_its_text_and_one_result(c, specs, got)
        c.close()
    finally:
        cluster.stop()


def test_an_unreachable_cluster_is_a_lost_connection():
    """Both cluster clients' topology refresh turns "no node answers" into ClusterUnreachable, a
    ConnectionError that every reconnect loop waits out (the asyncio client's NodesManager has
    __slots__: it gets a subclass instead of a patched method, which once broke its start)."""
    import asyncio

    import redis

    from genpool.schemas.connection import ClusterUnreachable, connect_async

    async def main():
        r = connect_async("redis+cluster://127.0.0.1:1")
        with pytest.raises(ClusterUnreachable):
            await r.initialize()
        assert issubclass(ClusterUnreachable, redis.ConnectionError)
    asyncio.run(main())
