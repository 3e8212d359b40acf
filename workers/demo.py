"""`genpool demo`: Redis (embedded if needed) + a worker subprocess + a streamed summary.

Every piece is the real one: the worker is `genpool worker` in a child process, the text arrives
token by token through the job's Redis stream, exactly as any producer would read it.
"""
from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from producer.cli import add_connection_args


def register(sub) -> None:
    p = sub.add_parser("demo", help="start Redis + a worker and stream a document summary")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--max-tokens", type=int, default=120)
    p.add_argument("--keep-worker", action="store_true", help="leave the worker running")
    add_connection_args(p)
    p.set_defaults(func=cmd_demo)


def _start_worker(model: Path, url: str, prefix: str, log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "workers.cli", "worker", "--model", str(model), "--redis", url,
           "--prefix", prefix, "--name", f"demo-{os.getpid()}", "--max-num-seqs", "8"]
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root),
                                                                   os.environ.get("PYTHONPATH")])))
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log_path, "wb"), env=env)


def _wait_ready(client, proc: subprocess.Popen, log_path: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited ({proc.returncode}); log: {log_path}\n"
                               + log_path.read_text()[-2000:])
        if any(w["alive"] for w in client.status()["workers"]):
            return
        time.sleep(0.5)
    raise RuntimeError(f"worker not ready after {timeout} s; log: {log_path}")


def cmd_demo(a: argparse.Namespace) -> int:
    from engine.models.registry import resolve_model
    from producer import Client
    from producer.config import genpool_home

    from .demo_doc import DOCUMENT, TITLE
    from .embedded import ensure_redis

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    url, server = ensure_redis(a.redis)
    print(f"[redis] {url}" + (" (embedded server started)" if server else ""), file=sys.stderr)
    print(f"[model] resolving {a.model} (first run downloads and converts it)...", file=sys.stderr)
    model = resolve_model(a.model)
    prefix = a.prefix or f"demo-{uuid.uuid4().hex[:8]}"
    log_path = genpool_home() / "demo-worker.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    client = Client(url, prefix)
    proc = _start_worker(model, url, prefix, log_path)
    try:
        print(f"[worker] starting (pid {proc.pid}, log {log_path})...", file=sys.stderr)
        _wait_ready(client, proc, log_path)
        print(f"\nSummary of \"{TITLE}\":\n", file=sys.stderr)
        job = client.submit(messages=[{"role": "user", "content": "Summarize this document in "
                                       f"three sentences.\n\n{DOCUMENT}"}],
                            max_tokens=a.max_tokens, temperature=0.0)
        for ev in job.stream(timeout=900):
            print(ev.text, end="", flush=True)
        res = job.result(timeout=60)
        if res.error:
            print(f"\nerror ({res.error.code}): {res.error.message}", file=sys.stderr)
            return 1
        t = res.timings
        print(f"\n\n[{res.usage.completion_tokens} tokens, first after {t.ttft_s:.2f} s, "
              f"total {t.total_s:.2f} s, via Redis stream {client.keys.events(job.id)}]",
              file=sys.stderr)
        return 0
    finally:
        if not a.keep_worker:
            proc.terminate()
            proc.wait(60)
            if not a.prefix:  # a throwaway prefix: leave nothing behind
                _drop_prefix(client)
        if server is not None and not a.keep_worker:
            server.stop()


def _drop_prefix(client) -> None:
    keys = list(client.redis.scan_iter(match=f"{client.keys.prefix}:*", count=1000))
    for i in range(0, len(keys), 500):
        client.redis.delete(*keys[i:i + 500])
