"""A finished batch's output and error files, made from its done hash (one answer per custom_id,
so each custom_id is in exactly one of them, once), in input line order. Their ids are derived
from the batch id, so a driver that dies while writing them and its successor write the same."""
from __future__ import annotations

import json
import time

from genpool.schemas import Keys
from genpool.schemas.batches import BatchView, FileRecord

from .batch_lines import ident
from .batch_store import FileStore


async def write_results(r, keys: Keys, files: FileStore, view: BatchView) -> dict[str, str]:
    """Write the files; {"output_file_id": id or "", "error_file_id": id or ""}."""
    bid = view.record.id
    answers = sorted((json.loads(v) for v in (await r.hgetall(keys.batch_done(bid))).values()),
                     key=lambda a: a["n"])
    out = {}
    for field, kind, ok in (("output_file_id", "output", True), ("error_file_id", "error", False)):
        rows = [a["line"] for a in answers if a["ok"] is ok]
        if not rows:
            out[field] = ""
            continue
        text = "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in rows)
        rec = FileRecord(id=f"file-{ident(bid)}-{kind}", bytes=len(text.encode()),
                         created_at=int(time.time()), filename=f"{bid}_{kind}.jsonl",
                         purpose="batch_output", lines=len(rows), owner=view.record.owner)
        await files.put(rec, text)
        out[field] = rec.id
    return out
