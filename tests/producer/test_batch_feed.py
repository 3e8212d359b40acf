"""How a batch's lines reach the queue (producer/batch_feed.py), against real gateways and a
fake-engine worker: batches feed the bulk lane earliest deadline first, and a prompt prefix's
other lines are submitted only once its first line has been computed."""
from __future__ import annotations

import io

import pytest

from genpool.producer.batch_lines import line_job_id
from genpool.schemas import Keys
from genpool.schemas.batches import PREFIX_GATE_S
from genpool.schemas.connection import connect
from tests.batch_api_helpers import Gateway, fake_worker, jsonl, line, read_file, wait_done
from tests.pool_helpers import drop_prefix, new_prefix, stop_proc, wait_for, workers_alive


@pytest.fixture
def pool(redis_url, tmp_path):
    prefix = new_prefix("bfeed")
    worker = fake_worker(redis_url, prefix, tmp_path, "w", step_delay=0.01, seqs=2)
    late = Gateway(redis_url, prefix, tmp_path, "late", "--batch-window", "600",
                   "--batch-in-flight", "4")
    soon = Gateway(redis_url, prefix, tmp_path, "soon", "--batch-window", "120",
                   "--batch-in-flight", "4")
    try:
        late.start()
        soon.start()
        wait_for(lambda: workers_alive(redis_url, prefix), 60, what="worker up")
        yield late, soon, redis_url, prefix
    finally:
        late.stop()
        soon.stop()
        stop_proc(worker)
        drop_prefix(redis_url, prefix)


def create(gw: Gateway, lines: list[dict], endpoint: str = "/v1/completions"):
    c = gw.client()
    f = c.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    return c, c.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h")


def test_the_batch_whose_window_ends_first_goes_first(pool):
    """A batch created later with a sooner window end overtakes one already running: the first
    one only has its first windows' lines answered when the second ends."""
    late, soon, url, prefix = pool
    c1, first = create(late, [line(f"a{i}", f"first {i}", max_tokens=20) for i in range(30)])
    wait_for(lambda: c1.batches.retrieve(first.id).status == "in_progress", 30,
             what="the first batch running")
    c2, second = create(soon, [line(f"b{i}", f"second {i}", max_tokens=20) for i in range(30)])
    assert second.expires_at < first.expires_at
    assert wait_done(c2, second.id, 120).status == "completed"
    done = wait_done(c1, first.id, 120)
    assert done.status == "completed" and done.request_counts.completed == 30
    # counted by the lines' own finish times: a count read once the second batch was seen
    # completed also held what the first finished while the status polls and the gateway's
    # pass were under way (about 10 lines a second here)
    r, keys = connect(url, decode_responses=True), Keys(prefix)
    try:
        def ended(batch, custom_id: str) -> float:
            return float(r.hget(keys.job(line_job_id(batch.id, custom_id)), "finished_at"))
        second_end = max(ended(second, f"b{i}") for i in range(30))
        behind = sum(ended(first, f"a{i}") < second_end for i in range(30))
    finally:
        r.close()
    assert behind <= 12, behind  # its first window or two, not the 30 FIFO order would give


def at(entries) -> float:
    """When a stream entry was written: its id starts with the time in ms."""
    return int(entries[0][0].split("-")[0]) / 1000


def test_a_prefix_runs_its_first_line_then_the_rest(pool):
    """3 documents x 4 questions: each document's first question is submitted first; the other
    three only once it has a first token PREFIX_GATE_S old, or its answer."""
    late, _, url, prefix = pool
    docs = [f"Document {d}: " + f"text of document {d}. " * 40 for d in range(3)]
    # first questions long enough (2 s) that the gate, not their answer, lets the others go
    lines = [line(f"d{d}q{q}", "", endpoint="/v1/chat/completions",
                  max_tokens=200 if q == 0 else 5) for q in range(4) for d in range(3)]
    for ln in lines:
        d, q = int(ln["custom_id"][1]), int(ln["custom_id"][3])
        ln["body"]["messages"] = [{"role": "system", "content": docs[d]},
                                  {"role": "user", "content": f"question {q}?"}]
    c, b = create(late, lines, "/v1/chat/completions")
    done = wait_done(c, b.id, 120)
    assert done.status == "completed" and len(read_file(c, done.output_file_id)) == 12
    r, keys = connect(url, decode_responses=True), Keys(prefix)
    try:
        for d in range(3):
            lead = line_job_id(b.id, f"d{d}q0")
            first_token = at(r.xrange(keys.events(lead), count=1))
            ended = at(r.xrevrange(keys.events(lead), count=1))
            lead_sent = float(r.hget(keys.job(lead), "submitted_at"))
            for q in range(1, 4):
                sent = float(r.hget(keys.job(line_job_id(b.id, f"d{d}q{q}")), "submitted_at"))
                assert sent > lead_sent and sent >= min(first_token + PREFIX_GATE_S,
                                                         ended) - 0.05, (d, q)
    finally:
        r.close()


def test_token_id_prompts_are_prefixes_of_their_own(pool):
    """Lines with token-id prompts (lm-eval batches) group by their ids: a line whose ids share
    nothing with a long-running first line is not held behind it (all of them had one key)."""
    late, _, url, prefix = pool
    lines = [line("lead", "", max_tokens=200)] + [line(f"o{i}", "", max_tokens=5)
                                                  for i in range(3)]
    for i, ln in enumerate(lines):
        ln["body"]["prompt"] = [100 * (i + 1) + k for k in range(12)]
    c, b = create(late, lines)
    done = wait_done(c, b.id, 120)
    assert done.status == "completed" and len(read_file(c, done.output_file_id)) == 4
    r, keys = connect(url, decode_responses=True), Keys(prefix)
    try:
        lead = line_job_id(b.id, "lead")
        first_token = at(r.xrange(keys.events(lead), count=1))
        for i in range(3):
            sent = float(r.hget(keys.job(line_job_id(b.id, f"o{i}")), "submitted_at"))
            assert sent < first_token + PREFIX_GATE_S - 0.05, i
    finally:
        r.close()


def test_a_long_check_renews_the_batchs_lease():
    """50,000 lines of schemas take longer to check than the 5 s lease: the lease lapsed under
    the check, the first bad line's answer found it lost, and the whole expansion began again
    every pass, until the window ended."""
    import asyncio
    import time
    from types import SimpleNamespace

    from genpool.producer.batch_driver import BatchDriver

    renewals = []

    async def renew(bid):
        renewals.append(bid)
    d = SimpleNamespace(checks=None, lease_ms=300, renew=renew)
    got = asyncio.run(BatchDriver.off_loop(d, lambda: time.sleep(0.5) or "checked", bid="b1"))
    assert got == "checked" and len(renewals) >= 3, renewals  # every lease / 3 = 0.1 s
