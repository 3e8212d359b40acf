"""`genpool demo`: Redis (embedded if needed) + a worker subprocess + a streamed summary.

Every piece is the real one: the worker is `genpool worker` in a child process, the text arrives
token by token through the job's Redis stream, exactly as any producer would read it.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

from genpool.schemas.config import HELP_FMT, add_connection_args
from genpool.schemas.connection import delete_prefix, redact


def register(sub) -> None:
    p = sub.add_parser("demo", help="start Redis + a worker and stream a document summary",
                       description="A one-command tour of genpool with real parts: uses the Redis "
                       "at --redis / $GENPOOL_REDIS_URL / 127.0.0.1:6379, or starts the embedded "
                       "one; pulls and converts the model on first use (into $GENPOOL_HOME, "
                       "default ~/.cache/genpool); starts `genpool worker` in a child process; "
                       "submits a summary job and prints its tokens as they arrive through the "
                       "job's Redis stream; then stops the worker and deletes its keys.",
                       formatter_class=HELP_FMT)
    p.add_argument("--model", default="smollm2-135m", help="registry name or checkpoint dir")
    p.add_argument("--max-tokens", type=int, default=200,
                   help="most tokens in the summary (a sentence the budget cuts is not shown)")
    p.add_argument("--keep-worker", action="store_true", help="leave the worker running")
    add_connection_args(p)
    p.set_defaults(func=cmd_demo)


class Sentences:
    """Stop rule for the printed summary: text is shown a whole sentence at a time, and a
    sentence the token budget cut off is dropped (a small model's summary that ends
    "...and in 1987, the light" reads as broken)."""

    END = re.compile(r"[.!?][\"')\]]*(?=\s)")

    def __init__(self) -> None:
        self.held = ""

    def feed(self, text: str) -> str:
        self.held += text
        ends = list(self.END.finditer(self.held))
        if not ends:
            return ""
        out, self.held = self.held[:ends[-1].end()], self.held[ends[-1].end():]
        return out

    def end(self, finish_reason) -> str:
        held, self.held = self.held, ""
        return "" if finish_reason == "length" and not re.search(r"[.!?][\"')\]]*\s*$", held) \
            else held


def _start_worker(model: Path, url: str, prefix: str, log_path: Path) -> subprocess.Popen:
    # -P: the working directory (often the checkout, whose engine/ kernels/ ... folders are
    # genpool.* only) must not shadow other distributions' top-level `kernels` and the like
    cmd = [sys.executable, "-P", "-m", "genpool.workers.cli.main", "worker", "--model", str(model), "--redis", url,
           "--prefix", prefix, "--name", f"demo-{os.getpid()}", "--max-num-seqs", "8"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log_path, "wb"))


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
    from genpool.engine.models.registry import is_pulled, lookup, resolve_model
    from genpool.producer import Client
    from genpool.schemas.config import genpool_home
    from genpool.workers.integrations.embedded import ensure_redis

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    url, server = ensure_redis(a.redis)
    print(f"[redis] {redact(url)}" + (" (embedded server started)" if server else ""),
          file=sys.stderr)
    first = lookup(a.model) is not None and not is_pulled(a.model)
    print(f"[model] {a.model}: " + ("first use: downloading and converting it (a minute or "
                                    "two)..." if first else "resolving..."), file=sys.stderr)
    model = resolve_model(a.model)
    prefix = a.prefix or f"demo-{uuid.uuid4().hex[:8]}"
    log_path = genpool_home() / "demo-worker.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    client = Client(url, prefix)
    proc = _start_worker(model, url, prefix, log_path)
    try:
        print(f"[worker] starting (pid {proc.pid}, log {log_path})...", file=sys.stderr)
        _wait_ready(client, proc, log_path)
        return _stream_summary(client, a.max_tokens)
    finally:
        if not a.keep_worker:
            proc.terminate()
            proc.wait(60)
            if not a.prefix:  # a throwaway prefix: leave nothing behind
                delete_prefix(client.redis, client.keys.prefix)
        if server is not None and not a.keep_worker:
            server.stop()


def _stream_summary(client, max_tokens: int) -> int:
    """Submit the summary job, print its sentences as they complete, then its timings."""
    from genpool.workers.cli.demo_doc import DOCUMENT, TITLE

    print(f"\nSummary of \"{TITLE}\":\n", file=sys.stderr)
    job = client.submit(messages=[{"role": "user", "content": "Summarize this document in "
                                   f"three short sentences.\n\n{DOCUMENT}"}],
                        max_tokens=max_tokens, temperature=0.0)
    out = Sentences()
    for ev in job.stream(timeout=900, raise_on_error=False):
        print(out.feed(ev.text), end="", flush=True)
    res = job.result(timeout=60, raise_on_error=False)
    held = len(out.held)
    tail = out.end(res.finish_reason)
    print(tail, end="", flush=True)
    if held and not tail:
        print(f"\n[{held} characters of a sentence cut off at --max-tokens not shown]",
              file=sys.stderr)
    if res.error:
        print(f"\nerror ({res.error.code}): {res.error.message}", file=sys.stderr)
        return 1
    t = res.timings
    print(f"\n\n[{res.usage.completion_tokens} tokens, first after {t.ttft_s:.2f} s, "
          f"total {t.total_s:.2f} s, via Redis stream {client.keys.events(job.id)}]",
          file=sys.stderr)
    return 0
