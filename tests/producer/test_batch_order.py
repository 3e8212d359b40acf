"""A batch feeds each prompt prefix's first line, then its other lines, prefix after prefix in
input order (producer/batch_feed.py). The order key was built from line numbers shifted by 17
bits: blank lines can push numbers past 2**17, and a prefix's later lines then sorted after the
next prefix's first. The real driver and stores in this process, a real Redis; no worker (the
order is set when the batch expands, before any line is submitted)."""
from __future__ import annotations

import asyncio
import json
import time

from genpool.producer.aio import AsyncClient
from genpool.producer.batch_driver import BatchDriver
from genpool.producer.batch_feed import PREFIX_CHARS
from genpool.producer.batch_lines import line_job_id
from genpool.producer.batch_store import BatchStore, FileStore
from genpool.schemas.batches import BatchRecord, FileRecord
from tests.pool_helpers import drop_prefix, new_prefix


def line(cid: str, doc: str, q: str) -> str:
    prompt = f"{doc} " * (PREFIX_CHARS // len(doc) + 1) + q
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions",
                       "body": {"model": "m", "prompt": prompt, "max_tokens": 2}})


async def expand(redis_url: str, prefix: str, text: str) -> list[str]:
    client = AsyncClient(redis_url, prefix)
    r, keys = client.redis, client.keys
    files, batches = FileStore(r, keys), BatchStore(r, keys)
    driver = BatchDriver(client, files, batches)
    now = int(time.time())
    f = FileRecord(id="file-order", bytes=len(text), created_at=now, filename="in.jsonl",
                   purpose="batch", lines=4)
    await files.put(f, text)
    rec = BatchRecord(id="batch_order", endpoint="/v1/completions", input_file_id=f.id,
                      completion_window="24h", created_at=now, expires_at=now + 3600)
    await batches.create(rec, 4)
    try:
        await driver.tick()  # validating -> in_progress: the lines and their order are stored
        assert (await batches.get(rec.id)).status == "in_progress"
        return await r.zrange(keys.batch_todo(rec.id), 0, -1)
    finally:
        await driver.close()
        await client.close()


def test_a_prefixs_lines_stay_together_past_2_to_the_17_line_numbers(redis_url):
    text = "\n".join([line("a1", "doc A", "q1"), line("b1", "doc B", "q1")] + [""] * 140_000
                     + [line("a2", "doc A", "q2"), line("b2", "doc B", "q2")]) + "\n"
    prefix = new_prefix("border")
    try:
        todo = asyncio.run(expand(redis_url, prefix, text))
    finally:
        drop_prefix(redis_url, prefix)
    assert todo == [line_job_id("batch_order", c) for c in ("a1", "a2", "b1", "b2")], todo
