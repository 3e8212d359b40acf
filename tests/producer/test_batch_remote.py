"""`genpool batch --remote`: a file run by a gateway's Batch API, followed by the CLI, against a
real gateway and a fake-engine worker; a rerun follows the batch it started."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.batch_api_helpers import KEY, Gateway, fake_completion, fake_worker, jsonl, line
from tests.pool_helpers import ROOT, drop_prefix, new_prefix, stop_proc, wait_for, workers_alive


@pytest.fixture
def gateway(redis_url, tmp_path):
    prefix = new_prefix("bremote")
    worker = fake_worker(redis_url, prefix, tmp_path, "w")
    gw = Gateway(redis_url, prefix, tmp_path, "gw", "--batch-window", "600")
    try:
        gw.start()
        wait_for(lambda: workers_alive(redis_url, prefix), 60, what="worker up")
        yield gw
    finally:
        gw.stop()
        stop_proc(worker)
        drop_prefix(redis_url, prefix)


def cli(gw: Gateway, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "genpool.workers.cli.main", "batch",
                           "--remote", gw.base, "--api-key", KEY, "--no-progress", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_remote_batch_writes_output_and_errors(gateway, tmp_path):
    lines = [line(f"c{i}", f"prompt {i}", max_tokens=5) for i in range(30)]
    lines[7]["body"]["temperature"] = "warm"
    src, out, errs = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    src.write_bytes(jsonl(lines))
    r = cli(gateway, str(src), "-o", str(out), "--errors-out", str(errs))
    assert r.returncode == 1, r.stderr  # one line failed
    assert "29 completed, 1 errors" in r.stderr
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(x["custom_id"] for x in got) == sorted(f"c{i}" for i in range(30) if i != 7)
    for x in got:
        i = int(x["custom_id"][1:])
        assert x["response"]["body"]["choices"][0]["text"] == fake_completion(f"prompt {i}", 5)
    assert [json.loads(x)["custom_id"] for x in errs.read_text().splitlines()] == ["c7"]
    assert not (tmp_path / "out.jsonl.batch").exists()


def test_a_rerun_follows_the_batch_it_started(gateway, tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes(jsonl([line(f"f{i}", f"p {i}") for i in range(5)]))
    c = gateway.client()
    f = c.files.create(file=("in.jsonl", src.read_bytes()), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    # as an interrupted run leaves it: the state file names the batch
    (tmp_path / "out.jsonl.batch").write_text(json.dumps({"batch_id": b.id}))
    r = cli(gateway, str(src), "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert f"following {b.id}" in r.stderr
    assert len(out.read_text().splitlines()) == 5
    assert len(list(c.batches.list())) == 1  # nothing submitted again


def test_a_refused_file_exits_2(gateway, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}\n'
                   "not json\n")
    r = cli(gateway, str(src), "-o", str(tmp_path / "out.jsonl"))
    assert r.returncode == 2 and "line 2" in r.stderr, r.stderr
