"""Admission work that can take seconds (JSON of megabytes, chat templates, tokenizing) runs here,
on a thread of its own, so a burst of huge requests never stalls the engine loop.

Small entries (the common case) are prepared inline, where it costs microseconds and adds no
step of latency; only entries above INLINE_BYTES come here. The loop collects finished ones with
ready() each tick. The thread uses its own copy of the tokenizer (the loop detokenizes with the
engine's at the same time).
"""
from __future__ import annotations

import copy
import logging
import queue
import threading
from typing import Callable

from genpool.workers.job import Entry, Job

log = logging.getLogger("genpool.worker")
INLINE_BYTES = 64 << 10


def private_tokenizer(tokenizer):
    try:
        return copy.deepcopy(tokenizer)
    except Exception:  # noqa: BLE001 - not copyable: share it (encode does not mutate it)
        return tokenizer


class Preparer:
    def __init__(self, prepare: Callable[[Entry], Job]):
        self._prepare = prepare
        self._in: queue.Queue = queue.Queue()
        self._out: list[Job] = []
        self._lock = threading.Lock()
        self._pending = 0
        self._thread = threading.Thread(target=self._run, name="genpool-prepare", daemon=True)
        self._thread.start()

    @staticmethod
    def is_big(entry: Entry) -> bool:
        raw = entry.payload()
        return raw is not None and len(raw) > INLINE_BYTES

    def submit(self, entry: Entry) -> None:
        with self._lock:
            self._pending += 1
        self._in.put(entry)

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    def ready(self) -> list[Job]:
        with self._lock:
            out, self._out = self._out, []
            self._pending -= len(out)
            return out

    def close(self) -> None:
        self._in.put(None)
        self._thread.join(10)

    def _run(self) -> None:
        while True:
            entry = self._in.get()
            if entry is None:
                return
            try:
                parsed = self._prepare(entry)
            except Exception as exc:  # noqa: BLE001 - never lose an entry
                log.exception("preparing entry %s failed", entry.entry_id)
                parsed = Job(entry, dead_reason=f"could not be prepared: "
                                               f"{type(exc).__name__}: {exc}")
            with self._lock:
                self._out.append(parsed)
