"""A finished batch's output and error files, made from its done hash (one answer per custom_id,
so each custom_id is in exactly one of them, once), in input line order. Their ids are derived
from the batch id, so a driver that dies while writing them and its successor write the same."""
from __future__ import annotations

import json
import time
from typing import Callable, Optional, Protocol, TypeVar

from genpool.schemas import Keys
from genpool.schemas.batches import BatchView, FileRecord

from .batch_lines import ident
from .batch_store import FileStore

T = TypeVar("T")


class Lease(Protocol):
    """The driver's hold on the batch while its files are made (producer/batch_driver.py)."""

    async def renew(self, bid: str) -> None: ...

    async def off_loop(self, fn: Callable[..., T], *args, bid: Optional[str] = None) -> T: ...


async def write_results(r, keys: Keys, files: FileStore, view: BatchView,
                        lease: Lease) -> dict[str, str]:
    """Write the files; {"output_file_id": id or "", "error_file_id": id or ""}. Tens of
    thousands of answers take seconds to order and render: that runs on the check threads, the
    lease renewed meanwhile and between the steps (a lease lost mid-way began the files again,
    for ever)."""
    bid = view.record.id
    answers: dict[str, str] = {}
    async for cid, stored in r.hscan_iter(keys.batch_done(bid), count=1000):
        answers[cid] = stored  # (a dict: HSCAN may name a field twice)
        if len(answers) % 20_000 == 0:
            await lease.renew(bid)
    rendered = await lease.off_loop(render, list(answers.values()), bid=bid)
    out = {}
    for (field, kind), (text, size, lines) in zip(
            (("output_file_id", "output"), ("error_file_id", "error")), rendered):
        if not lines:
            out[field] = ""
            continue
        rec = FileRecord(id=f"file-{ident(bid)}-{kind}", bytes=size, created_at=int(time.time()),
                         filename=f"{bid}_{kind}.jsonl", purpose="batch_output", lines=lines,
                         owner=view.record.owner)
        await lease.renew(bid)
        await files.put(rec, text)
        out[field] = rec.id
    await lease.renew(bid)
    return out


def render(stored: list[str]) -> list[tuple[str, int, int]]:
    """(text, bytes, lines) of the output file, then of the error file, in input line order."""
    answers = sorted((json.loads(v) for v in stored), key=lambda a: a["n"])
    files = []
    for ok in (True, False):
        rows = [json.dumps(a["line"], ensure_ascii=False) + "\n" for a in answers if a["ok"] is ok]
        text = "".join(rows)
        files.append((text, len(text.encode()), len(rows)))
    return files
