"""The OpenAI Files and Batch API on the gateway, through the official `openai` client, against
real gateway processes and a fake-engine worker process (the answers do not depend on a model).

Two gateways share the prefix: `a` (a long window) and `b` (a 3-second window, for expiry).
Either serves any batch, and either may drive it."""
from __future__ import annotations

import io
import time

import openai
import pytest

from tests.batch_api_helpers import (
    Gateway,
    fake_completion,
    fake_worker,
    jsonl,
    line,
    read_file,
    wait_done,
)
from tests.pool_helpers import drop_prefix, new_prefix, stop_proc, wait_for, workers_alive


@pytest.fixture(scope="module")
def pool(redis_url, tmp_path_factory):
    prefix, logs = new_prefix("obatch"), tmp_path_factory.mktemp("obatch")
    worker = fake_worker(redis_url, prefix, logs, "ob-w")
    a = Gateway(redis_url, prefix, logs, "a", "--batch-window", "600",
                "--max-file-bytes", "200000")
    b = Gateway(redis_url, prefix, logs, "b", "--batch-window", "3")
    try:
        a.start()
        b.start()
        wait_for(lambda: workers_alive(redis_url, prefix) or worker.poll() is not None, 60,
                 what="worker up")
        assert worker.poll() is None, (logs / "ob-w.log").read_text()[-3000:]
        yield {"a": a, "b": b, "url": redis_url, "prefix": prefix, "logs": logs}
    finally:
        a.stop()
        b.stop()
        stop_proc(worker)
        drop_prefix(redis_url, prefix)


def upload(client: openai.OpenAI, lines: list[dict], name: str = "in.jsonl"):
    return client.files.create(file=(name, io.BytesIO(jsonl(lines))), purpose="batch")


def test_the_whole_lifecycle(pool):
    """files.create, batches.create, retrieve until done, files.content: every line answered
    once, in OpenAI's line format; the states seen follow OpenAI's lifecycle; any gateway
    reports the batch."""
    c = pool["a"].client()
    lines = [line(f"q{i}", f"question {i}", max_tokens=3 + i % 4) for i in range(20)]
    lines += [line(f"chat{i}", f"hello {i}", endpoint="/v1/chat/completions")
              for i in range(2)]
    f = upload(c, lines[:20])
    assert (f.object, f.purpose, f.status, f.filename) == ("file", "batch", "processed", "in.jsonl")
    assert c.files.retrieve(f.id).bytes == f.bytes == len(jsonl(lines[:20]))
    assert c.files.content(f.id).content == jsonl(lines[:20])
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                         completion_window="24h", metadata={"job": "lifecycle"})
    assert b.status == "validating" and b.request_counts.total == 20
    assert b.metadata == {"job": "lifecycle"}
    seen = [b.status]
    done = wait_done(c, b.id, seen=seen)
    assert done.status == "completed", done
    assert all(s in ("validating", "in_progress", "finalizing", "completed") for s in seen), seen
    assert seen == sorted(seen, key=["validating", "in_progress", "finalizing",
                                     "completed"].index)
    assert done.request_counts.completed == 20 and done.request_counts.failed == 0
    assert done.in_progress_at and done.completed_at and done.error_file_id is None
    out = read_file(c, done.output_file_id)
    assert sorted(x["custom_id"] for x in out) == sorted(f"q{i}" for i in range(20))
    for x in out:
        i = int(x["custom_id"][1:])
        assert x["error"] is None and x["response"]["status_code"] == 200
        body = x["response"]["body"]
        assert body["object"] == "text_completion"
        assert body["usage"]["completion_tokens"] == 3 + i % 4
        assert body["choices"][0]["text"] == fake_completion(f"question {i}", 3 + i % 4)
    assert pool["b"].client().batches.retrieve(b.id).status == "completed"
    out_file = c.files.retrieve(done.output_file_id)
    assert out_file.purpose == "batch_output"


def test_200_lines_with_5_invalid_answer_each_custom_id_once(pool):
    c = pool["a"].client()
    lines = [line(f"r{i}", f"doc {i % 7} question {i}") for i in range(200)]
    bad = {3: {"temperature": "hot"}, 50: {"max_tokens": -1}, 99: {"n": 99},
           150: {"frobnicate": True}, 199: {"top_p": 7}}
    for i, extra in bad.items():
        lines[i]["body"].update(extra)
    b = c.batches.create(input_file_id=upload(c, lines).id, endpoint="/v1/completions",
                         completion_window="24h")
    done = wait_done(c, b.id)
    assert done.status == "completed"
    assert (done.request_counts.total, done.request_counts.completed,
            done.request_counts.failed) == (200, 195, 5)
    out, err = read_file(c, done.output_file_id), read_file(c, done.error_file_id)
    ids = [x["custom_id"] for x in out + err]
    assert len(ids) == len(set(ids)) == 200
    assert sorted(x["custom_id"] for x in err) == sorted(f"r{i}" for i in bad)
    for x in err:
        assert x["response"]["status_code"] == 400
        assert x["response"]["body"]["error"]["type"] == "invalid_request_error"


def test_bad_uploads_are_refused_with_openai_errors(pool):
    c = pool["a"].client()
    with pytest.raises(openai.BadRequestError) as e:
        c.files.create(file=("x.jsonl", io.BytesIO(b"this is not json\n")), purpose="batch")
    assert "line 1" in e.value.message and e.value.code == "invalid_file"
    with pytest.raises(openai.BadRequestError) as e:
        c.files.create(file=("x.jsonl", io.BytesIO(jsonl([line("a", "x")]))),
                       purpose="fine-tune")
    assert e.value.code == "invalid_value" and "purpose" in e.value.message
    lines = [line("a", "x"), line("a", "y"), {"custom_id": "c", "method": "GET",
                                             "url": "/v1/completions", "body": {}}]
    with pytest.raises(openai.BadRequestError) as e:
        upload(c, lines)
    assert "line 2" in e.value.message and "repeats" in e.value.message
    assert "line 3" in e.value.message and "POST" in e.value.message
    with pytest.raises(openai.APIStatusError) as e:  # the gateway `a` keeps 200 kB at most
        c.files.create(file=("big.jsonl", io.BytesIO(b" " * 300_000)), purpose="batch")
    assert e.value.status_code == 413 and e.value.code == "file_too_large"
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve("file-nope")
    with pytest.raises(openai.NotFoundError):
        c.batches.create(input_file_id="file-nope", endpoint="/v1/completions",
                         completion_window="24h")
    with pytest.raises(openai.BadRequestError):
        c.batches.create(input_file_id=upload(c, [line("a", "x")]).id,
                         endpoint="/v1/embeddings", completion_window="24h")
    # a no-break space after the JSON: str.strip() took it at upload, the driver's parse did not
    # (the batch then stayed `validating` for good); a list for `endpoint` was a 500
    nbsp = jsonl([line("a", "x")]).rstrip(b"\n") + "\u00a0\n".encode()
    with pytest.raises(openai.BadRequestError) as e:
        c.files.create(file=("x.jsonl", io.BytesIO(nbsp)), purpose="batch")
    assert "line 1" in e.value.message and e.value.code == "invalid_file"
    with pytest.raises(openai.BadRequestError) as e:
        c.batches.create(input_file_id=upload(c, [line("a", "x")]).id,
                         endpoint=["/v1/completions"], completion_window="24h")
    assert e.value.param == "endpoint"


def test_unknown_model_lines_fail_alone(pool):
    c = pool["a"].client()
    lines = [line(f"m{i}", f"p {i}") for i in range(6)]
    lines[2]["body"]["model"] = "no-such-model"
    lines[4]["body"]["model"] = "gpt-nothing"
    done = wait_done(c, c.batches.create(input_file_id=upload(c, lines).id,
                                         endpoint="/v1/completions",
                                         completion_window="24h").id)
    assert done.status == "completed" and done.request_counts.failed == 2
    err = read_file(c, done.error_file_id)
    assert sorted(x["custom_id"] for x in err) == ["m2", "m4"]
    assert {x["response"]["body"]["error"]["code"] for x in err} == {"model_not_found"}
    assert len(read_file(c, done.output_file_id)) == 4


def test_cancel_mid_run_keeps_what_finished(pool):
    c = pool["a"].client()
    lines = [line(f"k{i}", f"slow {i}", max_tokens=2 if i < 4 else 400) for i in range(40)]
    b = c.batches.create(input_file_id=upload(c, lines).id, endpoint="/v1/completions",
                         completion_window="24h")
    wait_for(lambda: c.batches.retrieve(b.id).request_counts.completed >= 4, 60,
             what="the short lines done")
    t0 = time.monotonic()
    assert c.batches.cancel(b.id).status in ("cancelling", "cancelled")
    done = wait_done(c, b.id, 60)
    assert done.status == "cancelled" and done.cancelled_at and done.cancelling_at
    assert time.monotonic() - t0 < 15
    out, err = read_file(c, done.output_file_id), read_file(c, done.error_file_id)
    assert {f"k{i}" for i in range(4)} <= {x["custom_id"] for x in out}
    ids = [x["custom_id"] for x in out + err]
    assert len(ids) == len(set(ids)) == 40
    assert {x["error"]["code"] for x in err} == {"batch_cancelled"}
    assert done.request_counts.completed == len(out) and done.request_counts.failed == len(err)
    with pytest.raises(openai.ConflictError):
        c.batches.cancel(wait_done(c, c.batches.create(
            input_file_id=upload(c, [line("z", "z")]).id, endpoint="/v1/completions",
            completion_window="24h").id).id)


def test_expiry_with_a_short_window(pool):
    """Gateway `b` gives batches 3 s: lines that cannot finish by then end batch_expired, what
    finished is kept, and the batch ends `expired`."""
    c = pool["b"].client()
    lines = [line(f"e{i}", f"long {i}", max_tokens=2 if i < 2 else 3000) for i in range(12)]
    b = c.batches.create(input_file_id=upload(c, lines).id, endpoint="/v1/completions",
                         completion_window="24h")
    assert b.expires_at - b.created_at <= 4
    done = wait_done(c, b.id, 60)
    assert done.status == "expired" and done.expired_at
    out, err = read_file(c, done.output_file_id), read_file(c, done.error_file_id)
    assert {x["custom_id"] for x in out} == {"e0", "e1"}
    assert sorted(x["custom_id"] for x in err) == sorted(f"e{i}" for i in range(2, 12))
    assert {x["error"]["code"] for x in err} == {"batch_expired"}


def test_list_and_pagination(pool):
    c = pool["a"].client()
    fid = upload(c, [line("l", "x")]).id
    made = [c.batches.create(input_file_id=fid, endpoint="/v1/completions",
                             completion_window="24h").id for _ in range(5)]
    first = c.batches.list(limit=2)
    assert [b.id for b in first.data] == made[::-1][:2] and first.has_more
    walked = [b.id for b in c.batches.list(limit=2)]
    assert walked[:5] == made[::-1] and len(walked) == len(set(walked))
    files = [f.id for f in c.files.list(purpose="batch", limit=2)]
    assert fid in files and len(files) == len(set(files))
    assert c.files.delete(fid).deleted
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(fid)
    with pytest.raises(openai.BadRequestError):
        c.batches.list(limit=1000)


def test_a_batch_on_a_redis_cluster(cluster_url, tmp_path):
    """The same lifecycle with every key on a Redis Cluster: each script touches one batch's
    slot, listings live in the prefix's slot."""
    prefix = new_prefix("obatchc")
    worker = fake_worker(cluster_url, prefix, tmp_path, "cw")
    gw = Gateway(cluster_url, prefix, tmp_path, "c", "--batch-window", "600")
    try:
        gw.start()
        wait_for(lambda: workers_alive(cluster_url, prefix), 60, what="worker up")
        c = gw.client()
        lines = [line(f"c{i}", f"cluster {i}") for i in range(30)]
        lines[4]["body"]["temperature"] = "hot"
        done = wait_done(c, c.batches.create(input_file_id=upload(c, lines).id,
                                             endpoint="/v1/completions",
                                             completion_window="24h").id)
        assert done.status == "completed"
        out, err = read_file(c, done.output_file_id), read_file(c, done.error_file_id)
        assert len(out) == 29 and [x["custom_id"] for x in err] == ["c4"]
        assert [b.id for b in c.batches.list()] == [done.id]
    finally:
        gw.stop()
        stop_proc(worker)
        drop_prefix(cluster_url, prefix)
