"""`genpool batch`: an OpenAI Batch API file through the queue, bounded, resumable and crash-safe.

Crash safety rests on three choices:
- job ids are derived from (input file identity, custom_id), so a rerun after a kill submits the
  same ids; the queue's submit is idempotent per id, so jobs that were in flight are picked up
  (their stored results read back) instead of run twice;
- an output line is written only after its job finished, with one write + fsync, so a kill leaves
  at most one partial trailing line, which the next run cuts off before appending;
- the next run skips every custom_id already in the output, so nothing is written twice.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from genpool.schemas import JobResult

from .client import Client
from .jsonl import job_id_for, line_object
from .openai_format import ENDPOINTS, APIError, OpenAIRequest, completion_body, one_of, parse_body
from .pipeline import Poller, poll_results
from .progress import make_progress

BATCH_PRIORITY = 1  # the bulk lane: interactive work (gateway, priority < 0) goes first


def file_identity(path: Path) -> tuple[str, int]:
    """(content hash, number of non-blank lines): the same file content means the same batch."""
    h, lines = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for raw in f:
            h.update(raw)
            lines += bool(raw.strip())
    return h.hexdigest()[:16], lines


@dataclass
class Line:
    lineno: int
    custom_id: str
    job_id: str
    req: Optional[OpenAIRequest] = None
    error: Optional[dict] = None  # {"code", "message", "param", "line"} for an invalid line


def parse_line(raw: bytes, lineno: int, ident: str, model: Optional[str],
               priority: int) -> Union[Line, str]:
    """A Line (valid or invalid), or the reason the line cannot be used at all."""
    obj = line_object(raw)
    if isinstance(obj, str):
        return obj
    cid = obj["custom_id"]
    line = Line(lineno, cid, job_id_for(ident, cid))
    url, body = obj.get("url"), obj.get("body")
    try:
        if obj.get("method") != "POST":
            raise APIError(400, f"method must be POST (got {obj.get('method')!r})", param="method")
        if not one_of(url, ENDPOINTS):
            raise APIError(400, f"url must be one of {', '.join(ENDPOINTS)} (got {url!r})",
                           param="url")
        if isinstance(body, dict) and body.get("stream"):
            raise APIError(400, "stream is not supported in a batch", param="body.stream")
        line.req = parse_body(ENDPOINTS[url], body, priority=priority, default_model=model,
                              job_id=line.job_id)
    except APIError as e:
        line.error = {"code": "invalid_request", "message": e.message, "param": e.param,
                      "line": lineno}
    return line


class Output:
    """The output file: exclusive lock, done custom_ids, partial tail cut, durable appends."""

    def __init__(self, path: Path):
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise SystemExit(f"genpool batch: another run is writing {path}") from None
        self.done: set[str] = set()
        self.failed: set[str] = set()  # the custom_ids in `done` whose line is an error
        self.lines: set[int] = set()  # input line numbers recorded without a custom_id
        self.cut_bytes = self._load()

    def _load(self) -> int:
        with open(self.path, "rb") as f:
            data = f.read()
        keep = data.rfind(b"\n") + 1  # a kill mid-write leaves a partial last line: drop it
        if keep < len(data):
            os.ftruncate(self.fd, keep)
            os.fsync(self.fd)
        for raw in data[:keep].splitlines():
            try:
                obj = json.loads(raw)
            except ValueError:
                continue
            if isinstance(obj, dict):
                self._record(obj)
        return len(data) - keep

    def _record(self, obj: dict) -> None:
        cid = obj.get("custom_id")
        if isinstance(cid, str):
            self.done.add(cid)
            if obj.get("error") is not None:
                self.failed.add(cid)
        elif isinstance(obj.get("line"), int):
            self.lines.add(obj["line"])

    def write(self, obj: dict) -> None:
        data = (json.dumps(obj, ensure_ascii=False) + "\n").encode()
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]
        os.fsync(self.fd)
        self._record(obj)

    def close(self) -> None:
        os.close(self.fd)


def success_line(line: Line, res: JobResult) -> dict:
    return {"id": f"batch_req_{line.job_id}", "custom_id": line.custom_id,
            "response": {"status_code": 200, "request_id": line.job_id,
                         "body": completion_body(line.req, res)},
            "error": None}


def error_line(line: Line, error: dict) -> dict:
    return {"id": f"batch_req_{line.job_id}", "custom_id": line.custom_id, "line": line.lineno,
            "response": None, "error": error}


def unusable_line(lineno: int, reason: str, custom_id: Optional[str] = None) -> dict:
    """An input line that could not become a request (no JSON, no custom_id, a repeat)."""
    return {"id": None, "custom_id": custom_id, "line": lineno, "response": None,
            "error": {"code": "invalid_line", "message": reason, "line": lineno}}


@dataclass
class Counts:
    ok: int = 0
    errors: int = 0
    skipped: int = 0
    resumed: int = 0
    failed_before: int = 0  # lines of this input an earlier run answered with an error
    tokens: int = 0
    started: float = field(default_factory=time.monotonic)


class BatchRun:
    def __init__(self, client: Client, input_path: Path, output_path: Path, *,
                 max_in_flight: int = 64, model: Optional[str] = None,
                 priority: int = BATCH_PRIORITY, batch_id: Optional[str] = None,
                 progress: bool = True, errors_path: Optional[Path] = None):
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self.client, self.input_path, self.max_in_flight = client, input_path, max_in_flight
        self.model, self.priority = model, priority
        ident, self.total = file_identity(input_path)
        self.ident = batch_id or ident
        self.out = Output(output_path)
        # OpenAI's Batch API splits results: successes in the output, failures in an error file.
        # Without one, failures stay in the output (as before) and unusable lines only on stderr.
        self.errs = Output(errors_path) if errors_path else None
        done = self.out.done | (self.errs.done if self.errs else set())
        self.counts = Counts(resumed=len(done) + len(self.errs.lines if self.errs else ()))
        self.inflight: dict[str, Line] = {}
        self.resumed = frozenset(done)  # custom_ids an earlier run finished: skipped quietly
        # ...but a skipped failure is still a line without a success: the run must not pass.
        # (It is not retried: its job id, derived from the file, would read back the same end.)
        self.failed = frozenset(self.out.failed | (self.errs.done if self.errs else set()))
        self.seen: set[str] = set()  # custom_ids read by this run: a second one is reported
        self.bar = make_progress(self.total, self.counts.resumed, progress)

    def run(self) -> Counts:
        if self.out.cut_bytes:
            self._note(f"cut a partial last line ({self.out.cut_bytes} bytes) from the output")
        poller = Poller()
        try:
            with open(self.input_path, "rb") as f:
                lines = (p for p in enumerate(f, 1) if p[1].strip())
                exhausted = False
                while not exhausted or self.inflight:
                    if not exhausted:
                        exhausted = self._fill(lines)
                    poller.wait(self._collect() > 0)
        finally:
            self.bar.close()
            self.out.close()
            if self.errs is not None:
                self.errs.close()
        return self.counts

    def _fill(self, lines) -> bool:
        """Read lines until max_in_flight jobs are out; returns True once the input is done."""
        batch: list[Line] = []
        nxt: Optional[tuple] = (0, b"")
        while len(self.inflight) + len(batch) < self.max_in_flight:
            nxt = next(lines, None)
            if nxt is None:
                break
            line = parse_line(nxt[1], nxt[0], self.ident, self.model, self.priority)
            if isinstance(line, Line) and line.custom_id in self.resumed:
                self.counts.failed_before += line.custom_id in self.failed
                continue
            if isinstance(line, Line) and line.custom_id in self.seen:
                self._skip(nxt[0], f"custom_id {line.custom_id!r} repeats an earlier line")
                continue
            if isinstance(line, str):
                if self.errs is None or nxt[0] not in self.errs.lines:
                    self._skip(nxt[0], line)
                else:  # recorded as unusable by an earlier run: quiet, but still no success
                    self.counts.failed_before += 1
                continue
            self.seen.add(line.custom_id)
            if line.error is not None:
                self._finish(error_line(line, line.error), ok=False)
            else:
                batch.append(line)
        if batch:
            for line, job in zip(batch, self.client.submit_many([ln.req.kwargs for ln in batch])):
                self.inflight[job.id] = line
        return nxt is None

    def _collect(self) -> int:
        if not self.inflight:  # nothing out (e.g. only invalid lines so far): no round trip
            return 0
        done, lost = poll_results(self.client, list(self.inflight))
        for jid, res in done.items():
            line = self.inflight.pop(jid)
            if res.error is None:
                self.counts.tokens += res.usage.completion_tokens
                self._finish(success_line(line, res), ok=True)
            else:
                self._finish(error_line(line, {"code": res.error.code,
                                               "message": res.error.message}), ok=False)
        if lost:  # Redis lost them (restart without persistence): same ids, submitted again
            self._note(f"resubmitting {len(lost)} jobs Redis no longer knows")
            self.client.submit_many([self.inflight[jid].req.kwargs for jid in lost])
        return len(done)

    def _finish(self, obj: dict, ok: bool) -> None:
        (self.out if ok or self.errs is None else self.errs).write(obj)
        if ok:
            self.counts.ok += 1
        else:
            self.counts.errors += 1
        self._advance()

    def _skip(self, lineno: int, reason: str) -> None:
        self.counts.skipped += 1
        self._note(f"line {lineno}: {reason}; skipped")
        if self.errs is not None:
            self.errs.write(unusable_line(lineno, reason))
        self._advance()

    def _advance(self) -> None:
        elapsed = max(1e-6, time.monotonic() - self.counts.started)
        self.bar.set_postfix(ok=self.counts.ok, err=self.counts.errors,
                             skip=self.counts.skipped, inflight=len(self.inflight),
                             tok_s=f"{self.counts.tokens / elapsed:.1f}", refresh=False)
        self.bar.update(1)

    def _note(self, msg: str) -> None:
        self.bar.write(f"genpool batch: {msg}", file=sys.stderr)


def run_batch(input_path: Union[str, Path], output_path: Union[str, Path], *,
              client: Optional[Client] = None, **kwargs) -> Counts:
    """Run (or resume) a batch file; see BatchRun for the keyword arguments."""
    client = client or Client()
    return BatchRun(client, Path(input_path), Path(output_path), **kwargs).run()
