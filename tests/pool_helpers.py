"""Helpers for the worker-pool tests: unique prefixes, in-process and subprocess workers."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

from genpool.producer import Client
from genpool.schemas import Keys
from genpool.schemas.connection import connect, delete_prefix
from tests import hygiene

ROOT = Path(__file__).resolve().parent.parent


def tests_only_path() -> str:
    """A directory holding only a `tests` link to this checkout's tests/: child processes get it
    as PYTHONPATH (fake engines, helpers), never the checkout root with its product folders
    (which would shadow installed packages: Hugging Face's `kernels`, say)."""
    import hashlib
    import tempfile
    d = Path(tempfile.gettempdir()) / f"genpool-tests-path-{os.getuid()}-{hashlib.sha1(bytes(ROOT)).hexdigest()[:10]}"
    d.mkdir(exist_ok=True)
    link = d / "tests"
    if not link.is_symlink() or link.resolve() != ROOT / "tests":
        tmp = d / f".tests-{os.getpid()}"
        tmp.symlink_to(ROOT / "tests")
        os.replace(tmp, link)  # atomic: concurrent sessions never see a missing link
    return str(d)


def new_prefix(tag: str = "t") -> str:
    return f"test-{hygiene.SESSION}-{tag}-{uuid.uuid4().hex[:8]}"


@contextmanager
def client_env(url: str, tag: str):
    """(url, prefix, Client) under a fresh prefix; the client closed and the keys dropped after."""
    prefix = new_prefix(tag)
    c = Client(url, prefix)
    try:
        yield url, prefix, c
    finally:
        c.close()
        drop_prefix(url, prefix)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_ok(url: str) -> bool:
    """Whether GET url answers 200 (a server still starting, or gone, is False)."""
    import httpx
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


KOMBU_BINDINGS_TTL_S = 3600


def drop_prefix(url: str, prefix: str) -> None:
    """Delete this test's keys (never FLUSHDB: the database is shared), including the kombu binding
    of the Celery queue named after the prefix. Celery's shared bindings (celeryev, pidbox,
    deadlines) may still serve another test's app, so they get a TTL instead: kombu declares them
    again whenever an app connects."""
    r = connect(url)  # a cluster's scan_iter visits every master; delete splits by slot
    delete_prefix(r, prefix)
    bindings = list(r.scan_iter(match=f"_kombu.binding*.{prefix}", count=1000))
    if bindings:
        r.delete(*bindings)
    for key in r.scan_iter(match="_kombu.binding*", count=1000):
        if r.ttl(key) == -1:
            r.expire(key, KOMBU_BINDINGS_TTL_S)
    r.close()


@contextmanager
def worker_thread(engine, url: str, prefix: str, lane_shards: int = 1, **cfg):
    """A Worker running in a thread of this process (signals are not installed)."""
    from genpool.workers.worker import Worker, WorkerConfig

    cfg.setdefault("served_models", frozenset({"fake"}))
    cfg.setdefault("name", f"w-{uuid.uuid4().hex[:6]}")
    w = Worker(engine, connect(url, socket_timeout=10), Keys(prefix, lane_shards),
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


MAX_MODEL_PROCS = 2  # model-holding workers alive at once: keeps the suite's memory bounded
TEST_KV_BLOCKS = "1024"  # 16384 tokens: enough for every test job, small for any model
_model_procs: list[subprocess.Popen] = []


def spawn_worker(url: str, prefix: str, model: str, name: str, *extra: str, env=None,
                 log_path: Path | None = None) -> subprocess.Popen:
    """`genpool worker` in a child process (python -m so tests/ is importable for fakes), with a
    small KV budget unless the test sets one; at most MAX_MODEL_PROCS model workers at once."""
    fake = "--engine-factory" in extra
    if not fake:
        _model_procs[:] = [p for p in _model_procs if p.poll() is None]
        assert len(_model_procs) < MAX_MODEL_PROCS, (
            f"a test would run more than {MAX_MODEL_PROCS} model processes at once")
        if "--num-kv-blocks" not in extra:
            extra = (*extra, "--num-kv-blocks", TEST_KV_BLOCKS)
    cmd = [sys.executable, "-P", "-m", "genpool.workers.cli.main", "worker", "--model", str(model), "--redis", url,
           "--prefix", prefix, "--name", name, *extra]
    full_env = dict(os.environ, **(env or {}))
    err = open(log_path, "wb") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.DEVNULL, stderr=err)
    if not fake:
        _model_procs.append(proc)
    return proc


def wait_for(pred, timeout: float = 30.0, interval: float = 0.05, what="condition"):
    """Poll `pred` until truthy; `what` (a string, or a callable giving one at the timeout, to
    show the state the wait ended in) names the condition in the error."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for "
                         f"{what() if callable(what) else what}")


def workers_alive(url: str, prefix: str) -> int:
    r = connect(url)
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
    from genpool.engine import SamplingParams
    from genpool.schemas import JobRequest

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
