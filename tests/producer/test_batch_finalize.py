"""A batch ends, whatever its size or its stored data.

A batch whose result files take longer to write than the driver's lease still ends.
The files were made on the event loop after one lease renewal: with 5,000 answers of ~4 KB that
took longer than the lease, the state move that ends the batch found the lease lost, and the next
pass began the files again, and again: the batch stayed `finalizing` for good. Here the lease is
200 ms (the gateway's is 5 s) so that a test-sized batch outlasts it. A real Redis and the real
driver and stores, in this process; no gateway, no worker (the answers are written directly).

A batch whose step raises every pass (its stored input no longer parses) ends `failed`, saying
why, after MAX_STEP_FAILURES passes (and STEP_FAILURES_S): it stayed `validating` for good,
not cancellable."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time

from genpool.producer import batch_lines as bl
from genpool.producer.aio import AsyncClient
from genpool.producer.batch_driver import BatchDriver
from genpool.producer.batch_store import BatchStore, FileStore
from genpool.producer.batch_upkeep import MAX_STEP_FAILURES
from genpool.schemas.batches import BatchRecord, FileRecord
from tests.pool_helpers import drop_prefix, new_prefix

N, TEXT = 5000, "x" * 4000


def answer(i: int, ok: bool) -> str:
    if ok:
        line = {"id": f"r{i}", "custom_id": f"c{i}", "error": None,
                "response": {"status_code": 200, "request_id": f"j{i}",
                             "body": {"object": "text_completion", "text": TEXT}}}
    else:
        line = {"id": f"r{i}", "custom_id": f"c{i}", "response": None,
                "error": {"code": "batch_expired", "message": "not run"}}
    return bl.stored(i + 1, ok, line)


@contextlib.asynccontextmanager
async def driving(redis_url: str, prefix: str, rec_id: str, input_file_id: str, total: int,
                  **driver_kw):
    """(driver, redis, keys, files, batches) over a batch `rec_id` just created (validating)."""
    client = AsyncClient(redis_url, prefix)
    r, keys = client.redis, client.keys
    files, batches = FileStore(r, keys), BatchStore(r, keys)
    driver = BatchDriver(client, files, batches, **driver_kw)
    now = int(time.time())
    await batches.create(BatchRecord(id=rec_id, endpoint="/v1/completions",
                                     input_file_id=input_file_id, completion_window="24h",
                                     created_at=now, expires_at=now + 3600), total)
    try:
        yield driver, r, keys, files, batches
    finally:
        await driver.close()
        await client.close()


async def finalize(redis_url: str, prefix: str) -> tuple[str, dict, dict]:
    async with driving(redis_url, prefix, "batch_bigfiles", "file-gone", N,
                       lease_ms=200) as (driver, r, keys, files, batches):
        done = keys.batch_done("batch_bigfiles")
        for lo in range(0, N, 500):
            await r.hset(done, mapping={f"c{i}": answer(i, i % 10 != 0)
                                        for i in range(lo, lo + 500)})
        await r.expire(done, 3600)
        await r.hset(keys.batch("batch_bigfiles"), mapping={
            "status": "finalizing", "completed": N - N // 10, "failed": N // 10})
        for _ in range(4):
            await driver.tick()
            view = await batches.get("batch_bigfiles")
            if view.status == "completed":
                break
        out = await files.content(view.output_file_id) if view.output_file_id else ""
        err = await files.content(view.error_file_id) if view.error_file_id else ""
        return view.status, {"out": out, "err": err}, view.model_dump()


def test_files_that_outlast_the_lease_still_end_the_batch(redis_url):
    prefix = new_prefix("bfinal")
    try:
        status, files, view = asyncio.run(finalize(redis_url, prefix))
    finally:
        drop_prefix(redis_url, prefix)
    assert status == "completed", view
    out, err = files["out"].splitlines(), files["err"].splitlines()
    assert (len(out), len(err)) == (N - N // 10, N // 10)
    ids = [json.loads(x)["custom_id"] for x in out + err]
    assert sorted(ids) == sorted(f"c{i}" for i in range(N))  # each once
    assert [json.loads(x)["custom_id"] for x in err][:3] == ["c0", "c10", "c20"]  # line order


async def run_broken(redis_url: str, prefix: str) -> tuple[dict, bool]:
    # the count alone here; a gateway also waits STEP_FAILURES_S (60 s) from the first
    async with driving(redis_url, prefix, "batch_broken", "file-broken", 1,
                       fail_after=(MAX_STEP_FAILURES, 0.0)) as (driver, r, keys, files, batches):
        # what a peer holding the Redis URL (or a corrupted write) could leave as the input
        await files.put(FileRecord(id="file-broken", bytes=9, created_at=int(time.time()),
                                   filename="in.jsonl", purpose="batch", lines=1), "not json\n")
        for _ in range(MAX_STEP_FAILURES + 2):
            await driver.tick()
        view = await batches.get("batch_broken")
        return view.model_dump(), await r.zscore(keys.batches_active, "batch_broken") is not None


def test_a_batch_whose_step_keeps_failing_ends_failed_saying_why(redis_url):
    prefix = new_prefix("bbroken")
    try:
        view, active = asyncio.run(run_broken(redis_url, prefix))
    finally:
        drop_prefix(redis_url, prefix)
    assert view["status"] == "failed" and not active, view
    (err,) = view["errors"]
    assert err["code"] == "batch_step_failed" and "JSONDecodeError" in err["message"], err


def test_a_batch_fails_only_after_both_the_count_and_the_time():
    """Ten passes take 2.5 s: a passing fault (a cluster connection lost mid-write surfaces as a
    TypeError) must not fail a batch, so the count and a span both must pass."""
    from genpool.producer.batch_upkeep import StepFailures

    f = StepFailures(3, 0.3)
    assert [f.failed("b") for _ in range(5)] == [False] * 5  # the count, not the time
    time.sleep(0.35)
    assert f.failed("b") and not f.failed("b")  # then it starts again
    f.failed("c")
    f.ok("b")
    f.keep_only(["b"])  # "c" left the active set elsewhere
    assert f.since == {}


async def cancel_with_input_gone(redis_url: str, prefix: str) -> dict:
    # its file deleted, then a cancel, before any pass expanded it
    async with driving(redis_url, prefix, "batch_gone", "file-gone", 3) as (
            driver, r, keys, _, batches):
        await r.hset(keys.batch("batch_gone"), "status", "cancelling")
        for _ in range(3):
            await driver.tick()
        return (await batches.get("batch_gone")).model_dump()


def test_a_cancelled_batch_whose_input_is_gone_says_why_none_ran(redis_url):
    """It ended `cancelled` with 3 lines counted, none answered, and no word of why."""
    prefix = new_prefix("bgone")
    try:
        view = asyncio.run(cancel_with_input_gone(redis_url, prefix))
    finally:
        drop_prefix(redis_url, prefix)
    assert view["status"] == "cancelled", view
    (err,) = view["errors"]
    assert err["code"] == "input_file_missing" and "none of its 3 lines ran" in err["message"]
