"""A server-side batch through faults: the gateway that drives it SIGKILLed mid-batch (another
gateway takes it over after the lease, then the killed one comes back), and a worker SIGKILLed
mid-batch. The output is complete and exact every time: each custom_id once, every line's job
submitted once (deterministic ids), and, without a worker fault, run once (one attempt)."""
from __future__ import annotations

import io
import os
import signal
import time

import pytest

from genpool.producer.batch_lines import line_job_id
from genpool.schemas import Keys
from genpool.schemas.connection import connect
from tests.batch_api_helpers import Gateway, fake_completion, fake_worker, jsonl, line, read_file, wait_done
from tests.pool_helpers import drop_prefix, new_prefix, stop_proc, wait_for, workers_alive

N = 300


@pytest.fixture
def env(redis_url, tmp_path):
    prefix = new_prefix("bfault")
    procs: list = []
    gws: list[Gateway] = []
    try:
        yield {"url": redis_url, "prefix": prefix, "logs": tmp_path, "procs": procs, "gws": gws}
    finally:
        for g in gws:
            g.stop()
        for p in procs:
            stop_proc(p)
        drop_prefix(redis_url, prefix)


def start_batch(gw: Gateway, tag: str):
    c = gw.client()
    lines = [line(f"{tag}{i}", f"{tag} document {i % 9} q{i}", max_tokens=12) for i in range(N)]
    f = c.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    return c, c.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                               completion_window="24h"), lines


def check_exact(c, done, lines) -> None:
    assert done.status == "completed", done
    out, err = read_file(c, done.output_file_id), read_file(c, done.error_file_id)
    assert err == []
    by_id = {x["custom_id"]: x for x in out}
    assert len(out) == len(by_id) == N
    for ln in lines:
        text = by_id[ln["custom_id"]]["response"]["body"]["choices"][0]["text"]
        assert text == fake_completion(ln["body"]["prompt"], 12)
    assert (done.request_counts.completed, done.request_counts.failed) == (N, 0)


def attempts(url: str, prefix: str, batch_id: str, lines) -> list[int]:
    r, keys = connect(url, decode_responses=True), Keys(prefix)
    pipe = r.pipeline(transaction=False)
    for ln in lines:
        pipe.hget(keys.job(line_job_id(batch_id, ln["custom_id"])), "attempts")
    got = [int(x or 0) for x in pipe.execute()]
    r.close()
    return got


def test_gateway_sigkill_mid_batch_is_taken_over(env):
    url, prefix, logs = env["url"], env["prefix"], env["logs"]
    env["procs"].append(fake_worker(url, prefix, logs, "w1", step_delay=0.01))
    a = Gateway(url, prefix, logs, "a", "--batch-window", "600").start()
    env["gws"].append(a)
    wait_for(lambda: workers_alive(url, prefix), 60, what="worker up")
    c, b, lines = start_batch(a, "g")
    wait_for(lambda: c.batches.retrieve(b.id).request_counts.completed >= 40, 60,
             what="the batch under way")
    a.kill()  # the only gateway, and so the batch's driver, dies mid-batch
    b2 = Gateway(url, prefix, logs, "b", "--batch-window", "600").start()
    env["gws"].append(b2)
    mid = b2.client().batches.retrieve(b.id)
    assert mid.status == "in_progress" and mid.request_counts.completed < N
    a.start()  # the killed one comes back: two drivers now, one lease
    check_exact(c, wait_done(b2.client(), b.id, 120), lines)
    assert set(attempts(url, prefix, b.id, lines)) == {1}  # no line ran twice


def test_worker_sigkill_mid_batch(env):
    url, prefix, logs = env["url"], env["prefix"], env["logs"]
    w1 = fake_worker(url, prefix, logs, "w1", step_delay=0.01)
    env["procs"].append(w1)
    a = Gateway(url, prefix, logs, "a", "--batch-window", "600").start()
    env["gws"].append(a)
    wait_for(lambda: workers_alive(url, prefix), 60, what="worker up")
    c, b, lines = start_batch(a, "w")
    wait_for(lambda: c.batches.retrieve(b.id).request_counts.completed >= 40, 60,
             what="the batch under way")
    os.kill(w1.pid, signal.SIGKILL)
    w1.wait()
    env["procs"].append(fake_worker(url, prefix, logs, "w2", step_delay=0.01))
    check_exact(c, wait_done(c, b.id, 120), lines)
    assert min(attempts(url, prefix, b.id, lines)) == 1


@pytest.fixture
def private_redis(tmp_path):
    """A redis-server of this test's own, with an append-only file fsynced on every write, so a
    restart keeps everything: the batch, its lines and the jobs."""
    from tests.redis_topologies import Servers, TopologyUnavailable, free_ports

    try:
        port = free_ports(1, range(27400, 27600))[0]
        servers = Servers(tmp_path / "redis")
        servers.start(port, "--appendonly", "yes", "--appendfsync", "always")
    except (TopologyUnavailable, OSError) as e:
        pytest.skip(f"no private redis-server: {e}")
    try:
        yield servers, port
    finally:
        servers.stop()


def test_redis_restart_mid_batch(private_redis, tmp_path):
    servers, port = private_redis
    url, prefix, logs = f"redis://127.0.0.1:{port}/0", new_prefix("bredis"), tmp_path
    worker = fake_worker(url, prefix, logs, "w1", step_delay=0.01)
    a = Gateway(url, prefix, logs, "a", "--batch-window", "600").start()
    try:
        wait_for(lambda: workers_alive(url, prefix), 60, what="worker up")
        c, b, lines = start_batch(a, "r")
        wait_for(lambda: c.batches.retrieve(b.id).request_counts.completed >= 40, 60,
                 what="the batch under way")
        servers.shutdown(port)  # SIGTERM: the server writes its AOF and exits
        time.sleep(1.0)
        servers.restart(port)
        c = a.client(retries=5)  # the first request after the restart may meet a dead connection
        check_exact(c, wait_done(c, b.id, 180), lines)
        assert a.proc.poll() is None and worker.poll() is None
    finally:
        a.stop()
        stop_proc(worker)
