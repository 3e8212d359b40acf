"""Worker liveness: a key with a TTL (gone = worker dead) plus an info entry in the workers hash."""
from __future__ import annotations

import time

from genpool.schemas import Keys
from genpool.schemas.keys import WORKER_STALE_S, heartbeat_ttl_s
from genpool.schemas.workers import WorkerInfo, parse_worker_info


class Heartbeat:
    def __init__(self, r, keys: Keys, name: str, interval_s: float):
        self.r, self.keys, self.name = r, keys, name
        self.ttl_s = heartbeat_ttl_s(interval_s)  # survives two missed beats
        self.started = time.time()
        self.beats = 0

    def beat(self, info: WorkerInfo) -> None:
        doc = info.model_copy(update={"name": self.name, "started": self.started,
                                      "beat": time.time(), "ttl_s": self.ttl_s}).model_dump_json()
        pipe = self.r.pipeline(transaction=False)
        pipe.set(self.keys.worker(self.name), doc, ex=self.ttl_s)
        pipe.hset(self.keys.workers, self.name, doc)
        # every entry older than WORKER_STALE_S is pruned: a registry no worker has beaten for
        # that long (its workers all killed) holds nothing live, and goes on its own
        pipe.expire(self.keys.workers, WORKER_STALE_S)
        pipe.execute()
        self.beats += 1
        if self.beats % 30 == 1:
            self._prune()

    def _prune(self) -> None:
        now = time.time()
        for name, doc in self.r.hgetall(self.keys.workers).items():
            info, _ = parse_worker_info(doc)
            beat = info.beat if info is not None else 0.0  # unreadable: nobody can use it either
            if now - beat > WORKER_STALE_S:  # it died without saying goodbye
                self.r.hdel(self.keys.workers, name)

    def leave(self) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.delete(self.keys.worker(self.name))
        pipe.hdel(self.keys.workers, self.name)
        pipe.execute()
