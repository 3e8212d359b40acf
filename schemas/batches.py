"""The records of the server-side OpenAI Files and Batch API (producer/openai_files.py,
producer/openai_batches.py, producer/batch_driver.py), and their wire numbers.

A file's record and content live in one Redis hash (`Keys.file`), a batch's record in another
(`Keys.batch`): immutable fields in `record` (JSON of the model below), the mutable ones (status,
its timestamps, counts, output file ids) as plain hash fields that the scripts of
schemas/batch_scripts.py change one at a time. redis + pydantic only.
"""
from __future__ import annotations

import json
from typing import Any, Literal, Optional, get_args

from pydantic import BaseModel, ConfigDict, Field

from .tenants import DEFAULT_TENANT

# Files are kept in Redis up to this size: Redis holds the whole batch pipeline (jobs, results)
# already, so every gateway reads any file with no other shared store. Bigger files belong on a
# shared volume or object store (docs/protocol.md, "Files"); none is wired in yet.
MAX_FILE_BYTES = 64 << 20
MAX_BATCH_LINES = 50_000  # OpenAI's bound per batch file
# A tenant's batches not yet ended hold at most this many bytes of input: each batch copies its
# file's lines into Redis, so without it one 64 MiB file and a loop of 200-byte creates would
# fill Redis (which refuses every write once full). OpenAI bounds batches' enqueued tokens alike.
MAX_ACTIVE_BATCH_BYTES = 256 << 20
# A tenant's uploaded files hold at most this many bytes: files live in Redis for FILE_TTL_S, so
# without it a loop of 64 MiB uploads would fill it. Batch output and error files are not counted
# (their batches' inputs bound them). Twice MAX_ACTIVE_BATCH_BYTES: a tenant can keep the inputs
# of its running batches and upload the next ones.
MAX_TENANT_FILE_BYTES = 512 << 20
FILE_TTL_S = 30 * 86400  # how long an uploaded or produced file is kept
# A batch's keys (record, lines, results, lease) outlive its window by this much, so its status
# and files can be read after it ends.
BATCH_RETENTION_S = 30 * 86400
COMPLETION_WINDOWS = {"24h": 86400}  # the only window OpenAI accepts
DELETED_CURSOR_S = 86_400  # a deleted file's tombstone: a listing's cursor may still name it
STORAGE_LOCK_MS = 10_000  # a tenant's storage lock (an upload's or create's check and write)
STORAGE_LOCK_WAIT_S = 10.0  # how long a request waits for it before a 503
BATCH_LEASE_MS = 5000  # a driver's claim on a batch; a dead gateway's batch is taken over after it
BATCH_TICK_S = 0.25  # how often a gateway's driver looks at the active batches
BATCH_PRIORITY = 1  # the bulk lane: interactive work (the gateway's own, priority < 0) goes first
# A batch's lines are submitted a window at a time (producer/batch_feed.py), so the bulk lane holds
# the lines of the batch whose window ends first, and a prefix's first line runs before the rest.
BATCH_IN_FLIGHT = 256  # lines of one batch submitted and not yet answered, at most
PREFIX_CHARS = 512  # lines whose prompt text starts with the same this many characters share one
PREFIX_GATE_S = 1.5  # a prefix's other lines wait this long after its first line's first token
MAX_LIST_LIMIT = 100
# Webhooks on a batch's end: tries before the event is dead-lettered, the first retry's delay
# (doubling, at most WEBHOOK_MAX_DELAY_S), one POST's time limit.
WEBHOOK_TRIES, WEBHOOK_BACKOFF_S, WEBHOOK_MAX_DELAY_S, WEBHOOK_TIMEOUT_S = 8, 1.0, 600.0, 10.0
BAD_LINES_SHOWN = 10  # an upload refused for bad lines names this many of them
DEFAULT_OWNER = DEFAULT_TENANT  # the tenant of a record made by a caller no key maps to one

FilePurpose = Literal["batch", "batch_output"]
BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired",
                      "cancelling", "cancelled"]
TERMINAL_BATCH = ("failed", "completed", "expired", "cancelled")  # LIVE_BATCH: the others
LIVE_BATCH = tuple(s for s in get_args(BatchStatus) if s not in TERMINAL_BATCH)
# The status a batch's final (error) lines name for lines that never ran.
UNRUN_CODE = {"cancelled": "batch_cancelled", "expired": "batch_expired"}
# The hash fields of a batch that change; each `<state>_at` is set once, on entering that state.
STAMPS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
          "cancelling_at", "cancelled_at")


class FileRecord(BaseModel):
    """OpenAI's file object, plus the owner (not shown to callers)."""
    model_config = ConfigDict(extra="ignore")
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    expires_at: Optional[int] = None
    filename: str
    purpose: FilePurpose
    status: Literal["processed"] = "processed"
    status_details: Optional[str] = None
    lines: int = 0  # non-blank lines (a genpool extra; clients ignore it)
    owner: str = DEFAULT_OWNER

    def public(self) -> dict:
        return self.model_dump(exclude={"owner"})


class LineError(BaseModel):
    code: str
    message: str
    param: Optional[str] = None
    line: Optional[int] = None


class BatchRecord(BaseModel):
    """The immutable part of a batch (its `record` field)."""
    model_config = ConfigDict(extra="ignore")
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    metadata: Optional[dict[str, str]] = None
    owner: str = DEFAULT_OWNER
    model: Optional[str] = None  # the gateway's --model for lines that name none
    # what the creating key allows its lines (schemas/tenant_records.py ApiKey): these models
    # (empty: any), and no priority more urgent than this
    models: list[str] = Field(default_factory=list)
    priority_ceiling: int = BATCH_PRIORITY
    input_bytes: int = 0  # its input file's size: counted against MAX_ACTIVE_BATCH_BYTES


class BatchView(BaseModel):
    """A batch as it is now: the record plus its mutable fields (OpenAI's batch object)."""
    record: BatchRecord
    status: BatchStatus = "validating"
    stamps: dict[str, int] = Field(default_factory=dict)
    total: int = 0
    completed: int = 0
    failed: int = 0
    output_file_id: Optional[str] = None
    error_file_id: Optional[str] = None
    errors: list[LineError] = Field(default_factory=list)

    @classmethod
    def from_hash(cls, h: dict[str, str]) -> "BatchView":
        return cls(record=BatchRecord.model_validate_json(h["record"]),
                   status=h.get("status", "validating"),
                   stamps={k: int(float(h[k])) for k in STAMPS if h.get(k)},
                   total=int(h.get("total") or 0), completed=int(h.get("completed") or 0),
                   failed=int(h.get("failed") or 0), output_file_id=h.get("output_file_id") or None,
                   error_file_id=h.get("error_file_id") or None,
                   errors=[LineError(**e) for e in json.loads(h.get("errors") or "[]")])

    def public(self) -> dict[str, Any]:
        r = self.record
        return {"id": r.id, "object": "batch", "endpoint": r.endpoint, "errors":
                {"object": "list", "data": [e.model_dump() for e in self.errors]}
                if self.errors else None,
                "input_file_id": r.input_file_id, "completion_window": r.completion_window,
                "status": self.status, "output_file_id": self.output_file_id,
                "error_file_id": self.error_file_id, "created_at": r.created_at,
                "expires_at": r.expires_at, **{k: self.stamps.get(k) for k in STAMPS},
                "request_counts": {"total": self.total, "completed": self.completed,
                                   "failed": self.failed},
                "metadata": r.metadata}
