"""Helpers for the worker-pool tests: unique prefixes, in-process and subprocess workers."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import redis

from producer import Client
from schemas import Keys

ROOT = Path(__file__).resolve().parent.parent


def new_prefix(tag: str = "t") -> str:
    return f"test-{tag}-{uuid.uuid4().hex[:8]}"


def drop_prefix(url: str, prefix: str) -> None:
    """Delete this test's keys (never FLUSHDB: the database is shared)."""
    r = redis.Redis.from_url(url)
    keys = list(r.scan_iter(match=f"{prefix}:*", count=1000))
    for i in range(0, len(keys), 500):
        r.delete(*keys[i:i + 500])
    r.close()


@contextmanager
def worker_thread(engine, url: str, prefix: str, **cfg):
    """A Worker running in a thread of this process (signals are not installed)."""
    from workers.worker import Worker, WorkerConfig

    cfg.setdefault("served_models", frozenset({"fake"}))
    cfg.setdefault("name", f"w-{uuid.uuid4().hex[:6]}")
    w = Worker(engine, redis.Redis.from_url(url, socket_timeout=10), Keys(prefix),
               WorkerConfig(**cfg))
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    try:
        yield w
    finally:
        if not w.stopping:  # a second stop() means "now"; let a test's own stop() drain
            w.stop(drain_timeout_s=cfg.get("drain_timeout_s", 5.0))
        t.join(30)
        assert not t.is_alive(), "worker thread did not stop"


def spawn_worker(url: str, prefix: str, model: str, name: str, *extra: str, env=None,
                 log_path: Path | None = None) -> subprocess.Popen:
    """`genpool worker` in a child process (python -m so tests/ is importable for fakes)."""
    cmd = [sys.executable, "-m", "workers.cli", "worker", "--model", str(model), "--redis", url,
           "--prefix", prefix, "--name", name, *extra]
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    err = open(log_path, "wb") if log_path else subprocess.DEVNULL
    return subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.DEVNULL, stderr=err)


def wait_for(pred, timeout: float = 30.0, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def workers_alive(url: str, prefix: str) -> int:
    r = redis.Redis.from_url(url)
    keys = Keys(prefix)
    names = r.hkeys(keys.workers)
    n = sum(r.exists(keys.worker(n.decode())) for n in names)
    r.close()
    return n


def stop_proc(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    if proc.poll() is None:
        proc.terminate()
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def offline(llm, specs: list[dict]) -> dict[str, tuple[str, list[int]]]:
    """The same requests through LLM.generate (chat prompts built exactly like LLM.chat)."""
    from engine import SamplingParams
    from schemas import JobRequest

    eng = llm.llm_engine
    prompts, params = [], []
    for s in specs:
        req = JobRequest.model_validate({k if k != "job_id" else "id": v for k, v in s.items()})
        if req.messages:
            text = eng.apply_chat_template([m.model_dump() for m in req.messages])
            prompts.append({"prompt_token_ids": eng.tokenizer(text, add_special_tokens=False)
                            ["input_ids"]})
        else:
            prompts.append(req.prompt)
        params.append(SamplingParams(**req.sampling_kwargs()))
    outs = llm.generate(prompts, params)
    return {s["job_id"]: (o.outputs[0].text, list(o.outputs[0].token_ids))
            for s, o in zip(specs, outs)}


def collect(client: Client, jobs) -> dict[str, tuple[str, object]]:
    out = {}
    for job in jobs:
        streamed = "".join(e.text for e in job.stream(timeout=300))
        out[job.id] = (streamed, job.result())
    return out


def check(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for job_id, (streamed, res) in got.items():
        assert res.error is None, (job_id, res.error)
        assert streamed == res.text == want[job_id][0], job_id
        assert res.token_ids == want[job_id][1], job_id
