"""A tensor-parallel worker (N=3 gloo ranks) through real Redis: jobs stream and finish; SIGKILL of a
non-zero rank ends the whole worker at once and its jobs complete on another worker (`restart`)."""
from __future__ import annotations

import os
import signal
import time

import pytest

from genpool.producer import Client
from genpool.schemas import parse_event
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
from tests.tp_helpers import alive, child_pids, rank_pids, write_tiny

WORDS = "river stone lamp harbor winter signal copper garden market cloud engine paper".split()


@pytest.fixture(scope="module")
def tiny6(tmp_path_factory):
    """6 query heads over 3 KV heads (SmolLM2's ratio): N=3 gives each rank one KV head."""
    return write_tiny(tmp_path_factory.mktemp("tp_tiny6"), heads=6, kv_heads=3, context=8192)


@pytest.fixture(scope="module")
def tiny6_llm(tiny6):
    from genpool.engine import LLM

    return LLM(str(tiny6), max_num_seqs=32, num_threads=1, num_kv_blocks=512)


@pytest.fixture
def pool(redis_url, tmp_path):
    prefix = new_prefix("tp")
    procs: list = []

    def start(model, name, *extra):
        procs.append(spawn_worker(redis_url, prefix, model, name, "--heartbeat-s", "0.5", "--num-kv-blocks", "512",
                                  *extra,
                                  log_path=tmp_path / f"{name}.log"))
        wait_for(lambda: workers_alive(redis_url, prefix) >= len([p for p in procs if p.poll() is None]),
                 timeout=300, what="workers up")  # 3 ranks start on 2 busy cores
        return procs[-1]

    yield prefix, start, tmp_path
    for p in procs:
        ranks = child_pids(p.pid)
        stop_proc(p)
        for pid in ranks:  # never leave a rank behind, whatever happened above
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    drop_prefix(redis_url, prefix)


def spec(i: int, **kw) -> dict:
    text = " ".join(WORDS[(i * k) % len(WORDS)] for k in range(1, 4 + i % 6))
    s = {"job_id": f"j{i:04d}", "prompt": f"Record {i}: {text}", "max_tokens": 6 + i % 9, "temperature": 0.0}
    if i % 3 == 1:
        s = {**s, "prompt": None, "messages": [{"role": "user", "content": f"Tell me about {text}."}]}
        del s["prompt"]
    return {**s, **kw}


def test_tp3_worker_streams_and_finishes_jobs(redis_url, pool, tiny6, tiny6_llm):
    prefix, start, tmp = pool
    worker = start(tiny6, "tp3", "--tensor-parallel-size", "3", "--max-num-seqs", "8")
    assert len(rank_pids(worker.pid)) == 2  # ranks 1 and 2
    c = Client(redis_url, prefix)
    specs = [spec(i) for i in range(16)]
    jobs = [c.submit(**s) for s in specs]
    check(collect(c, jobs), offline(tiny6_llm, specs))  # greedy: the same tokens as one rank
    long = c.submit("Record 99: a long one", max_tokens=4000, ignore_eos=True)
    stream = long.stream(timeout=60)
    next(stream)
    long.cancel()  # cancellation is rank 0's business alone: the ranks just see smaller batches
    list(stream)
    assert long.result().error.code == "cancelled"
    after = c.submit(**spec(100))  # and the worker goes on serving
    check(collect(c, [after]), offline(tiny6_llm, [spec(100)]))
    ranks = rank_pids(worker.pid)
    assert stop_proc(worker, timeout=120) == 0  # SIGTERM drains and stops every rank
    assert not any(alive(p) for p in ranks)
    assert "tensor parallel: rank 0 of 3" in (tmp / "tp3.log").read_text()


def test_sigkill_of_a_nonzero_rank_ends_the_worker_and_jobs_finish_elsewhere(redis_url, pool, tiny6, tiny6_llm):
    prefix, start, tmp = pool
    victim = start(tiny6, "victim", "--tensor-parallel-size", "3", "--max-num-seqs", "16",
                   "--claim-idle-ms", "1500")
    ranks = rank_pids(victim.pid)
    assert len(ranks) == 2
    c = Client(redis_url, prefix)
    specs = [spec(i, max_tokens=240, ignore_eos=True) for i in range(12)]
    jobs = [c.submit(**s) for s in specs]
    wait_for(lambda: all(c.redis.exists(c.keys.events(j.id)) for j in jobs), timeout=120, interval=0.05,
             what="all jobs streaming")
    os.kill(ranks[0], signal.SIGKILL)
    t0 = time.monotonic()
    code = victim.wait(30)
    took = time.monotonic() - t0
    log = (tmp / "victim.log").read_text()
    assert code == 3, log[-2000:]
    assert took < 10 and f"tensor-parallel rank 1 (pid {ranks[0]}) died" in log
    wait_for(lambda: not any(alive(p) for p in ranks), timeout=10, what="the other rank to exit")
    assert sum(c.job(j.id).info().get("state") == "done" for j in jobs) == 0
    start(tiny6, "rescuer", "--max-num-seqs", "16", "--claim-idle-ms", "1500")
    got = collect(c, jobs)
    check(got, offline(tiny6_llm, specs))
    for j in jobs:
        events = [parse_event(f["event"]).type for _, f in c.redis.xrange(c.keys.events(j.id))]
        # the rescuer (same checkpoint, TP 1) resumed each job where the dead pair stopped
        assert "resume" in events and "restart" not in events, events
        assert events.count("result") == 1 and got[j.id][1].worker == "rescuer"
