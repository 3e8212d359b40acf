"""Real-model parity through the pool: SmolLM2-135M in a worker process vs the offline engine."""
from __future__ import annotations

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


def test_smollm2_through_redis_matches_offline(redis_url, smollm2_path, tmp_path):
    from genpool.engine import LLM

    prefix = new_prefix("smol")
    proc = spawn_worker(redis_url, prefix, "smollm2-135m", "smol", "--max-num-seqs", "8",
                        "--num-threads", "1", log_path=tmp_path / "worker.log")
    try:
        wait_for(lambda: workers_alive(redis_url, prefix) >= 1 or proc.poll() is not None,
                 timeout=300, what="worker up")
        assert proc.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
        c = Client(redis_url, prefix)
        capital = [{"role": "user", "content": "What is the capital of France?"}]
        specs = [
            {"job_id": "chat", "messages": capital, "max_tokens": 12, "temperature": 0.0,
             "model": "smollm2-135m"},
            {"job_id": "greedy", "prompt": "The lighthouse keeper", "max_tokens": 8,
             "temperature": 0.0},
            {"job_id": "seeded", "prompt": "Once upon a time", "max_tokens": 8,
             "temperature": 0.8, "top_p": 0.95, "seed": 42},
            {"job_id": "vip", "prompt": "Paris is", "max_tokens": 6, "temperature": 0.0,
             "priority": -1},
        ]
        jobs = [c.submit(**s) for s in specs]
        got = collect(c, jobs)
        want = offline(LLM(str(smollm2_path), max_num_seqs=8, num_threads=1), specs)
        check(got, want)
        assert got["chat"][1].text.startswith("The capital of France is Paris")
    finally:
        stop_proc(proc)
        drop_prefix(redis_url, prefix)

