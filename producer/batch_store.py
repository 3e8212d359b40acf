"""Where the Files and Batch API keep their records: Redis, shared by every gateway (asyncio).

Keys and scripts: schemas/keys.py (`Keys.file*`, `Keys.batch*`), schemas/batch_scripts.py.
Every key written here gets a TTL (files: FILE_TTL_S; batches: their window + BATCH_RETENTION_S).
"""
from __future__ import annotations

import time
from typing import Optional, TypeVar

from genpool.schemas import Keys
from genpool.schemas.batch_scripts import BATCH_MOVE_LUA
from genpool.schemas.batches import (
    BATCH_RETENTION_S,
    DELETED_CURSOR_S,
    FILE_TTL_S,
    BatchRecord,
    BatchView,
    FileRecord,
)
from genpool.schemas.scripting import Script

MOVE = Script(BATCH_MOVE_LUA)
T = TypeVar("T")


def valid_id(make_key, rid: str) -> Optional[str]:
    """The key of a record id, or None for an id no record can have (a 404, not a 500)."""
    try:
        return make_key(rid)
    except ValueError:
        return None


def batch_ttl_s(rec: BatchRecord) -> int:
    return max(1, rec.expires_at - int(time.time())) + BATCH_RETENTION_S


async def every_record(r, index: str, key_of, model: type[T]) -> list[T]:
    """The records of every id in the sorted set `index` that still has one (a tenant's bounds
    sum them: a few hundred bytes a record, one round trip for all)."""
    ids = await r.zrange(index, 0, -1)
    pipe = r.pipeline(transaction=False)
    for rid in ids:
        pipe.hget(key_of(rid), "record")
    return [model.model_validate_json(x) for x in await pipe.execute() if x]


async def page(r, index: str, after: Optional[str], limit: int, load) -> tuple[list, bool]:
    """Newest first, `limit` records after the id `after`: (records, has_more). `load(ids)` gives
    the visible records of those ids (None for one that is gone or not the caller's); ids whose
    record expired are dropped from the index on the way."""
    ids = await r.zrevrange(index, 0, -1)
    if after is not None and after not in ids:
        return [], False  # a cursor that is gone (deleted, expired): nothing after it
    start = ids.index(after) + 1 if after is not None else 0
    out, gone, i = [], [], start
    while i < len(ids) and len(out) <= limit:
        chunk = ids[i:i + limit + 1]
        for rid, rec in zip(chunk, await load(chunk)):
            if rec is False:
                gone.append(rid)
            elif rec is not None:
                out.append(rec)
        i += len(chunk)
    if gone:
        await r.zrem(index, *gone)
    return out[:limit], len(out) > limit


class FileStore:
    def __init__(self, r, keys: Keys):
        self.r, self.keys = r, keys

    async def put(self, rec: FileRecord, content: str) -> None:
        key, pipe = self.keys.file(rec.id), self.r.pipeline(transaction=False)
        pipe.hset(key, mapping={"record": rec.model_dump_json(), "content": content})
        pipe.expire(key, FILE_TTL_S)
        pipe.zadd(self.keys.files, {rec.id: time.time()})  # (seconds tie: listings by µs)
        pipe.expire(self.keys.files, FILE_TTL_S)  # the listing outlives the files it names
        await pipe.execute()

    async def get(self, fid: str) -> Optional[FileRecord]:
        key = valid_id(self.keys.file, fid)
        raw = key and await self.r.hget(key, "record")
        return FileRecord.model_validate_json(raw) if raw else None

    async def content(self, fid: str) -> Optional[str]:
        key = valid_id(self.keys.file, fid)
        return await self.r.hget(key, "content") if key else None

    async def uploaded_bytes(self, owner: str) -> int:
        """The bytes of `owner`'s uploaded files (purpose batch) still kept."""
        recs = await every_record(self.r, self.keys.files, self.keys.file, FileRecord)
        return sum(r.bytes for r in recs if r.owner == owner and r.purpose == "batch")

    async def delete(self, fid: str) -> None:
        """The file goes; a tombstone stays DELETED_CURSOR_S, its id in the listing: a listing's
        cursor may name it (the official client's auto-pagination asks for the page after the
        last id it saw, and a cleanup loop has just deleted that one)."""
        key, pipe = self.keys.file(fid), self.r.pipeline(transaction=True)
        pipe.delete(key)
        pipe.hset(key, "deleted", int(time.time()))
        pipe.expire(key, DELETED_CURSOR_S)
        await pipe.execute()

    async def list(self, after: Optional[str], limit: int, owner: str,
                   purpose: Optional[str]) -> tuple[list[FileRecord], bool]:
        async def load(ids):
            pipe = self.r.pipeline(transaction=False)
            for fid in ids:
                pipe.hmget(self.keys.file(fid), "record", "deleted")
            return [shown(raw, dead) for raw, dead in await pipe.execute()]

        def shown(raw: Optional[str], dead: Optional[str]):  # page()'s record, None or False
            if not raw:  # a tombstone stays listed (None), an expired file goes (False)
                return None if dead else False
            rec = FileRecord.model_validate_json(raw)
            return rec if rec.owner == owner and purpose in (None, rec.purpose) else None
        return await page(self.r, self.keys.files, after, limit, load)


class BatchStore:
    def __init__(self, r, keys: Keys):
        self.r, self.keys = r, keys

    async def create(self, rec: BatchRecord, total: int) -> None:
        key, ttl = self.keys.batch(rec.id), batch_ttl_s(rec)
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(key, mapping={"record": rec.model_dump_json(), "status": "validating",
                                "total": total, "completed": 0, "failed": 0})
        pipe.expire(key, ttl)
        pipe.zadd(self.keys.batches, {rec.id: time.time()})
        pipe.expire(self.keys.batches, ttl)
        pipe.zadd(self.keys.batches_active, {rec.id: rec.expires_at})
        pipe.expire(self.keys.batches_active, ttl)
        await pipe.execute()

    async def active_bytes(self, owner: str) -> int:
        """The input bytes of `owner`'s batches that have not ended."""
        recs = await every_record(self.r, self.keys.batches_active, self.keys.batch, BatchRecord)
        return sum(r.input_bytes for r in recs if r.owner == owner)

    async def get(self, bid: str) -> Optional[BatchView]:
        key = valid_id(self.keys.batch, bid)
        h = await self.r.hgetall(key) if key else None
        return BatchView.from_hash(h) if h and "record" in h else None

    async def list(self, after: Optional[str], limit: int,
                   owner: str) -> tuple[list[BatchView], bool]:
        async def load(ids):
            pipe = self.r.pipeline(transaction=False)
            for bid in ids:
                pipe.hgetall(self.keys.batch(bid))
            views = [BatchView.from_hash(h) if h and "record" in h else False
                     for h in await pipe.execute()]
            return [v if v is False or v.record.owner == owner else None for v in views]
        return await page(self.r, self.keys.batches, after, limit, load)

    async def move(self, bid: str, token: str, leave: tuple[str, ...], to: str,
                   stamp: Optional[str] = None, **fields) -> tuple[int, str]:
        """BATCH_MOVE_LUA: (1, old state) moved, (0, state) not from `leave`, (-1, "") lease lost."""
        args = [token, ",".join(leave), to, stamp or "", f"{time.time():.3f}"]
        for k, v in fields.items():
            args += [k, v]
        moved, state = await MOVE.acall(self.r, [self.keys.batch_lease(bid),
                                                 self.keys.batch(bid)], args)
        return int(moved), state
