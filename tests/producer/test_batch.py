"""`genpool batch`: OpenAI Batch files through a real worker, killed midway and resumed.

The kill test is the contract: every valid custom_id exactly once with a completion, every invalid
line exactly once with an error, the unparseable line reported and skipped, no partial line left,
and no job run twice (job ids are derived from the file + custom_id, so the resumed run picks up
the killed run's in-flight jobs instead of submitting new ones).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from genpool.producer.batch import Output, job_id_for, parse_line
from genpool.schemas.connection import connect
from tests.pool_helpers import ROOT, drop_prefix, new_prefix, spawn_worker, stop_proc, wait_for, workers_alive

N_VALID = 104
INVALID = {  # custom_id -> (line, error code)
    "bad-url": ({"method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
                "invalid_request"),
    "bad-method": ({"method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}},
                   "invalid_request"),
    "bad-temp": ({"method": "POST", "url": "/v1/chat/completions",
                  "body": {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}},
                 "invalid_request"),
    "no-prompt": ({"method": "POST", "url": "/v1/completions", "body": {"max_tokens": 3}},
                  "invalid_request"),
    "bad-model": ({"method": "POST", "url": "/v1/completions",  # only a worker can tell
                   "body": {"prompt": "x", "model": "no-such-model"}}, "unknown_model"),
}


def max_tokens(i: int) -> int:
    # Staggered lengths: jobs finish one by one, so a kill always finds some in flight.
    return 3 + 4 * (i % 5)


def valid_line(i: int) -> dict:
    common = {"max_tokens": max_tokens(i), "temperature": 0, "ignore_eos": True}
    if i % 2:
        return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": f"Question {i}?"}], **common}}
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": f"Item {i}:", **common}}


def write_input(path) -> None:
    lines = [json.dumps(valid_line(i)) for i in range(N_VALID)]
    for k, (cid, (line, _)) in enumerate(INVALID.items()):
        lines.insert(7 + 13 * k, json.dumps({"custom_id": cid, **line}))
    lines.insert(40, '{"custom_id": "torn", "method": "POST", "url"')  # unparseable
    path.write_text("\n".join(lines) + "\n")


def batch_cmd(url: str, prefix: str, inp, out) -> list[str]:
    return [sys.executable, "-P", "-m", "genpool.workers.cli.main", "batch", str(inp), "-o", str(out),
            "--redis", url, "--prefix", prefix, "--max-in-flight", "8"]


def count_lines(path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def test_batch_killed_midway_and_resumed(topology_url, tiny_llama_path, tmp_path):
    redis_url, prefix = topology_url, new_prefix("batch")  # one server, then a Redis Cluster
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(inp)
    # 2 slots against the runner's 8 in flight: ~6 of its jobs always wait in the lane, so the
    # kill finds jobs in flight however fast the model answers (with 8 slots a fast tiny model
    # sometimes answered everything submitted before the kill: 1 run in 3)
    worker = spawn_worker(redis_url, prefix, tiny_llama_path, "bw", "--max-num-seqs", "2",
                          "--num-threads", "1", log_path=tmp_path / "worker.log")
    env = dict(os.environ)
    r = connect(redis_url, decode_responses=True)
    try:
        wait_for(lambda: workers_alive(redis_url, prefix) or worker.poll() is not None, 240,
                 what="worker up")
        assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
        first = subprocess.Popen(batch_cmd(redis_url, prefix, inp, out), cwd=ROOT, env=env,
                                 stderr=open(tmp_path / "run1.err", "wb"))
        # 25 lines written and jobs out: the runner collects every job a poll finds done, then
        # submits more, so a kill right after a poll that found all 8 done found none in flight
        wait_for(lambda: (count_lines(out) >= 25 and jobs_out(r, prefix, out) > 0)
                 or first.poll() is not None, 240, 0.01, what="25 output lines, jobs out")
        first.send_signal(signal.SIGKILL)
        first.wait()
        assert in_flight_at_kill(r, prefix, out) > 0, "the kill left no job in flight"
        # A kill can also tear a line mid-write: simulate one, the rerun must cut it off.
        with open(out, "ab") as f:
            f.write(b'{"id": "batch_req_x", "custom_id": "req-1", "resp')
        second = subprocess.run(batch_cmd(redis_url, prefix, inp, out), cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=600)
        # the input holds invalid lines on purpose: a run that did not succeed on every line
        # says so with its exit code
        assert second.returncode == 1, second.stderr[-3000:]
        check_output(out, second.stderr)
        check_each_job_ran_once(r, prefix)
    finally:
        stop_proc(worker)
        drop_prefix(redis_url, prefix)


def job_keys(r, prefix: str) -> list[str]:
    return [k for k in r.scan_iter(f"{prefix}:job:{{batch-*", count=1000)
            if not k.endswith(":events")]


def jobs_out(r, prefix: str, out) -> int:
    """in_flight_at_kill() while the run writes: its last line may be partial."""
    rows = [json.loads(x) for x in out.read_bytes().split(b"\n")[:-1]]
    return len(job_keys(r, prefix)) - sum(bool(row["response"]) or row["error"]["code"] !=
                                          "invalid_request" for row in rows)


def in_flight_at_kill(r, prefix: str, out) -> int:
    """Jobs submitted whose line the killed run had not written yet."""
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    answered = [row for row in rows if row["response"] or row["error"]["code"] != "invalid_request"]
    assert len(rows) < N_VALID, "the batch finished before it could be killed"
    return len(job_keys(r, prefix)) - len(answered)


def check_output(out, stderr: str) -> None:
    rows = [json.loads(line) for line in out.read_text().splitlines()]  # every line parses
    ids = [row["custom_id"] for row in rows]
    assert len(ids) == len(set(ids)), "a custom_id was written twice"
    assert set(ids) == {f"req-{i}" for i in range(N_VALID)} | set(INVALID)
    for row in rows:
        if row["custom_id"] in INVALID:
            assert row["response"] is None
            assert row["error"]["code"] == INVALID[row["custom_id"]][1], row
            continue
        assert row["error"] is None and row["response"]["status_code"] == 200, row
        body = row["response"]["body"]
        i = int(row["custom_id"].removeprefix("req-"))
        assert body["usage"]["completion_tokens"] == max_tokens(i)
        chat = body["object"] == "chat.completion"
        choice = body["choices"][0]
        assert (choice["message"]["content"] if chat else choice["text"]), row
    assert "cut a partial last line" in stderr
    assert "not valid JSON" in stderr and "skipped" in stderr


def check_each_job_ran_once(r, prefix) -> None:
    jobs = job_keys(r, prefix)
    assert len(jobs) == N_VALID + 1  # + bad-model, which only a worker rejects
    ran = [k for k in jobs if r.hget(k, "result")]  # bad-model was refused, never started
    assert len(ran) == N_VALID
    attempts = [r.hget(k, "attempts") for k in ran]
    assert all(a == "1" for a in attempts), sorted(set(attempts))


def test_output_cuts_partial_line_and_knows_done_ids(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"custom_id": "a"}\n{"custom_id": "b"}\n{"custom_id": "c", "resp')
    o = Output(out)
    try:
        assert o.done == {"a", "b"} and o.cut_bytes > 0
        o.write({"custom_id": "c", "response": None, "error": {"code": "x", "message": "y"}})
    finally:
        o.close()
    assert [json.loads(x)["custom_id"] for x in out.read_text().splitlines()] == ["a", "b", "c"]
    o1 = Output(out)  # opens: the first writer released its lock
    try:
        with pytest.raises(SystemExit):  # a second writer is refused while the first holds it
            Output(out)
    finally:
        o1.close()


def test_a_repeated_custom_id_is_reported_even_after_the_first_finished(tmp_path):
    """Invalid lines finish at once, so the repeat arrives after its first copy is in the output;
    it must still be reported and counted as skipped, not dropped as if an earlier run did it."""
    from genpool.producer.batch import BatchRun

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    line = json.dumps({"custom_id": "dup", **INVALID["bad-temp"][0]})
    src.write_text(line + "\n" + line + "\n")
    counts = BatchRun(object(), src, out, progress=False).run()  # no job reaches a client
    assert (counts.errors, counts.skipped, counts.resumed) == (1, 1, 0)
    assert [json.loads(x)["custom_id"] for x in out.read_text().splitlines()] == ["dup"]
    again = BatchRun(object(), src, out, progress=False).run()  # resumed: both copies quiet
    assert (again.errors, again.skipped, again.resumed) == (0, 0, 1)


def test_parse_line_sorts_lines():
    line = parse_line(json.dumps(valid_line(3)).encode(), 1, "f00d", None, 1)
    assert line.error is None and line.req.kind == "chat"
    assert line.job_id == job_id_for("f00d", "req-3") == line.req.kwargs["job_id"]
    assert line.req.kwargs["priority"] == 1
    bad = parse_line(json.dumps({"custom_id": "x", **INVALID["bad-temp"][0]}).encode(), 2,
                     "f00d", None, 1)
    assert bad.error["param"] == "temperature" and bad.error["line"] == 2
    assert isinstance(parse_line(b"[1, 2]", 3, "f00d", None, 1), str)
    assert isinstance(parse_line(b'{"method": "POST"}', 4, "f00d", None, 1), str)
    assert "nested too deeply" in parse_line(b"[" * 100_000, 5, "f00d", None, 1)  # not a RecursionError
    tool_line = valid_line(7)
    tool_line["body"]["messages"].append({"role": "assistant", "content": 5,
                                          "tool_calls": [{"function": {"name": "f"}}]})
    assert parse_line(json.dumps(tool_line).encode(), 6, "f00d", None, 1).error["line"] == 6  # a line error


@pytest.mark.parametrize("errors_out", [False, True], ids=["failures-in-output", "errors-out"])
def test_a_rerun_exits_1_while_a_line_still_has_no_success(redis_url, tmp_path, errors_out):
    """A rerun that finds every line already answered must not report success while an answer
    is a failure (job ids are derived from the file, so the failed line fails again): it exits 1
    and says how many of the lines done earlier failed. With --errors-out an unusable line is
    recorded there by line number, and it still counts."""
    prefix = new_prefix("batchrerun")
    ok = {**valid_line(0), "custom_id": "ok"}
    lines = [json.dumps(ok), json.dumps({"custom_id": "bad-temp", **INVALID["bad-temp"][0]})]
    if errors_out:
        lines.append('{"custom_id": "torn"')  # unusable: no custom_id can be read
    inp, out, errs = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    # what an earlier run wrote for the good line (so no worker is needed here)
    out.write_text(json.dumps({"id": "batch_req_x", "custom_id": "ok", "error": None,
                               "response": {"status_code": 200, "body": {}}}) + "\n")
    cmd = batch_cmd(redis_url, prefix, inp, out) + ["--no-progress"]
    cmd += ["--errors-out", str(errs)] if errors_out else []
    try:
        first = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert first.returncode == 1, first.stderr
        rerun = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    finally:
        drop_prefix(redis_url, prefix)
    assert rerun.returncode == 1, rerun.stderr
    failed = 2 if errors_out else 1
    assert f"{failed} of them failed" in rerun.stderr, rerun.stderr
    assert count_lines(out) + count_lines(errs) == len(lines)  # the rerun wrote nothing
