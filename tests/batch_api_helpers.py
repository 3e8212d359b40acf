"""Helpers for the Batch API tests: gateway and fake-engine worker processes on one prefix,
batch input files, waiting for a batch to end, and reading its files."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import openai

from tests.fake_engine import expected_text
from tests.pool_helpers import ROOT, free_port, http_ok, spawn_worker, stop_proc, wait_for

KEY = "sk-genpool-batch-test"
DONE = ("completed", "failed", "expired", "cancelled")


class Gateway:
    """One `genpool gateway` process; start() again after kill() (same port)."""

    def __init__(self, url: str, prefix: str, logs: Path, name: str, *extra: str,
                 env: dict | None = None):
        self.url, self.prefix, self.logs, self.name, self.extra = url, prefix, logs, name, extra
        self.env = dict(os.environ, **(env or {}))
        self.port, self.proc, self.starts = free_port(), None, 0
        self.base = f"http://127.0.0.1:{self.port}"

    def start(self) -> "Gateway":
        self.starts += 1
        self.proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "genpool.workers.cli.main", "gateway", "--port",
             str(self.port), "--redis", self.url, "--prefix", self.prefix, "--api-key", KEY,
             "--log-level", "warning", *self.extra], cwd=ROOT, env=self.env,
            stderr=open(self.logs / f"{self.name}-{self.starts}.log", "wb"))
        wait_for(lambda: http_ok(f"{self.base}/health") or self.proc.poll() is not None, 60,
                 what=f"gateway {self.name} up")
        assert self.proc.poll() is None, self.log()
        return self

    def log(self) -> str:
        return (self.logs / f"{self.name}-{self.starts}.log").read_text()[-3000:]

    def client(self, retries: int = 0) -> openai.OpenAI:
        """retries: the official client's own retries of 5xx answers (a gateway answers 503 while
        its Redis is away)."""
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key=KEY, max_retries=retries)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None:
            stop_proc(self.proc, 10)


def fake_worker(url: str, prefix: str, logs: Path, name: str, step_delay: float = 0.002,
                seqs: int = 16):
    return spawn_worker(url, prefix, "fake", name, "--engine-factory", "tests.fake_engine:make",
                        "--max-num-seqs", str(seqs), "--claim-idle-ms", "1500",
                        "--heartbeat-s", "0.2",
                        env={"GENPOOL_FAKE_STEP_DELAY": str(step_delay)},
                        log_path=logs / f"{name}.log")


def line(cid: str, prompt: str, max_tokens: int = 4, endpoint: str = "/v1/completions",
         **body) -> dict:
    b = ({"prompt": prompt} if endpoint == "/v1/completions"
         else {"messages": [{"role": "user", "content": prompt}]})
    return {"custom_id": cid, "method": "POST", "url": endpoint,
            "body": {"model": "fake", "max_tokens": max_tokens, **b, **body}}


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def wait_done(client: openai.OpenAI, batch_id: str, timeout: float = 120.0, seen=None):
    """Poll until the batch ends; `seen` (a list) collects every status observed."""
    deadline = time.monotonic() + timeout
    while True:
        b = client.batches.retrieve(batch_id)
        if seen is not None and (not seen or seen[-1] != b.status):
            seen.append(b.status)
        if b.status in DONE:
            return b
        assert time.monotonic() < deadline, f"batch {batch_id} still {b.status}: {b}"
        time.sleep(0.1)


def read_file(client: openai.OpenAI, file_id) -> list[dict]:
    if not file_id:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines() if x]


def fake_completion(prompt: str, max_tokens: int) -> str:
    """What the fake engine answers a /v1/completions prompt (tests/fake_engine.py)."""
    from tests.fake_engine import FakeTokenizer

    return expected_text(FakeTokenizer()(prompt)["input_ids"], max_tokens)
