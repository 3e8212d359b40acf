"""A big batch does not stall the gateway (issue 31's server-side Batch API, under load): its
file's lines are parsed and checked, at upload and when the batch expands, on the gateway's check
threads, not on the event loop that serves every stream. A probe times GET /health every 20 ms
while a 20,000-line file of JSON-schema requests is uploaded and its batch expands; with the
checks on the loop, one /health took as long as the expansion (seconds).

A real `genpool gateway` process, real Redis, httpx; no worker (expansion needs none).
"""
from __future__ import annotations

import json
import threading
import time

import httpx

from tests.producer.test_gateway_limits import cli_gateway  # noqa: F401 (fixture)

N_LINES = 20_000


def line(i: int) -> bytes:
    props = {f"f{i}_{j}": {"type": "string", "maxLength": 20 + j} for j in range(6)}
    props["n"] = {"type": "array", "items": {"type": "integer", "minimum": i}}
    schema = {"type": "object", "properties": props, "required": list(props)}
    body = {"model": "m", "messages": [{"role": "user", "content": f"record {i}"}],
            "max_tokens": 8, "response_format": {"type": "json_schema",
                                                 "json_schema": {"name": f"s{i}", "schema": schema}}}
    return json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                       "body": body}).encode() + b"\n"


class Probe(threading.Thread):
    """GET /health every 20 ms; the longest answer it waited for."""

    def __init__(self, base: str):
        super().__init__(daemon=True)
        self.base, self.worst, self.done = base, 0.0, threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=60) as http:
            while not self.done.is_set():
                t0 = time.monotonic()
                assert http.get(f"{self.base}/health").status_code == 200
                self.worst = max(self.worst, time.monotonic() - t0)
                time.sleep(0.02)


def test_a_big_batch_is_checked_off_the_event_loop(cli_gateway):  # noqa: F811
    base = f"http://127.0.0.1:{cli_gateway}"
    data = b"".join(line(i) for i in range(N_LINES))
    probe = Probe(base)
    probe.start()
    try:
        with httpx.Client(timeout=120) as http:
            up = http.post(f"{base}/v1/files", data={"purpose": "batch"},
                           files={"file": ("big.jsonl", data)})
            assert up.status_code == 200, up.text
            batch = http.post(f"{base}/v1/batches", json={
                "input_file_id": up.json()["id"], "endpoint": "/v1/chat/completions",
                "completion_window": "24h"}).json()
            t0 = time.monotonic()
            while (state := http.get(f"{base}/v1/batches/{batch['id']}").json())["status"] \
                    == "validating":
                assert time.monotonic() - t0 < 120, "the batch never left validating"
                time.sleep(0.2)
            assert state["status"] == "in_progress", state
            assert state["request_counts"]["total"] == N_LINES, state
            http.post(f"{base}/v1/batches/{batch['id']}/cancel")
    finally:
        probe.done.set()
        probe.join(60)
    assert probe.worst < 1.0, f"a /health waited {probe.worst:.2f} s behind the batch's checks"
