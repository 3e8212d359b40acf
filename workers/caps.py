"""Tenants' pool-wide concurrency caps (TenantLimits.max_concurrent; issue 31), at claim time.

Before a tenant's job is claimed, it takes a slot in the tenant's running set (SLOT_LUA); at
the cap, the job stays held by this worker (its entry kept fresh, not counted as a taken slot) and is
tried again at the next admission, and fair pull skips the tenant meanwhile (workers/fair.py).
The lease thread renews the slots this worker holds; a job's end frees its slot with the next
admission or renewal; a worker that dies leaks nothing (its slots lapse after `slot_ms`). Only
tenants other than the default one, with a max_concurrent, are capped.
"""
from __future__ import annotations

import threading
import time
from typing import Optional

from genpool.schemas import Keys
from genpool.schemas.scripting import Script, pipelined
from genpool.schemas.tenant_records import read_limits
from genpool.schemas.tenant_scripts import SLOT_LUA
from genpool.schemas.tenants import DEFAULT_TENANT, KEY_CACHE_S, TenantKeys
from genpool.workers.job import Job

SLOT = Script(SLOT_LUA)
CACHE_MAX = 10_000  # tenants' caps remembered; past it the cache starts over


class ConcurrencyCaps:
    def __init__(self, r, keys: Keys, slot_ms: int, worker: str):
        self.r, self.t, self.slot_ms = r, TenantKeys(keys), slot_ms
        # a slot is `<job id>@<worker>`: a worker that lost a job's lease and frees its slot
        # never frees the new owner's (both count meanwhile: never over the cap)
        self.suffix = "@" + worker
        self.caps: dict[str, tuple[float, Optional[int]]] = {}  # tenant -> (until, cap)
        self.held: dict[str, str] = {}  # job id -> tenant, slots this worker holds
        self.freed: list[tuple[str, str]] = []  # (job id, tenant) ended, slot not yet removed
        self.full: set[str] = set()  # tenants at their cap at the last try (fair pull skips)
        self.lock = threading.Lock()  # the lease thread renews while the loop acquires

    def _cap(self, tenant: str) -> Optional[int]:
        hit = self.caps.get(tenant)
        if hit is None or hit[0] < time.monotonic():
            cap = read_limits(self.r.get(self.t.limits(tenant))).max_concurrent
            if len(self.caps) >= CACHE_MAX:  # tenant names come from jobs: any number of them
                self.caps.clear()
            self.caps[tenant] = hit = (time.monotonic() + KEY_CACHE_S, cap)
        return hit[1]

    def acquire(self, jobs: list[Job]) -> list[Job]:
        """Take a slot for each capped tenant's job; the jobs refused (their tenant is full)."""
        capped = [(j, j.req.tenant, cap) for j in jobs
                  if j.req is not None and j.error is None and j.req.tenant != DEFAULT_TENANT
                  and j.job_id not in self.held
                  and (cap := self._cap(j.req.tenant)) is not None]
        self.flush()
        if not capped:
            return []
        answers = pipelined(self.r, capped, lambda pipe, c: SLOT.queue(
            pipe, [self.t.running(c[1])], [c[0].job_id + self.suffix, c[2], self.slot_ms,
                                            "acquire"]), [SLOT],
            raise_errors=True)
        refused, full = [], set()
        with self.lock:
            for (j, tenant, _), ok in zip(capped, answers):
                if ok == 1:
                    self.held[j.job_id] = tenant
                else:
                    refused.append(j)
                    full.add(tenant)
        self.full = full
        return refused

    def release(self, job_id: Optional[str]) -> None:
        """The job ended here (any way): its slot goes at the next flush."""
        with self.lock:
            tenant = self.held.pop(job_id, None) if job_id is not None else None
            if tenant is not None:
                self.freed.append((job_id, tenant))

    def flush(self) -> None:
        with self.lock:
            freed, self.freed = self.freed, []
        if freed:
            pipe = self.r.pipeline(transaction=False)
            for job_id, tenant in freed:
                pipe.zrem(self.t.running(tenant), job_id + self.suffix)
            pipe.execute(raise_on_error=False)  # lost: the slot lapses at its deadline

    def renew(self) -> None:
        """The lease thread's turn: free ended jobs' slots, extend the held ones."""
        self.flush()
        with self.lock:
            held = list(self.held.items())
        if held:
            pipelined(self.r, held, lambda pipe, h: SLOT.queue(
                pipe, [self.t.running(h[1])], [h[0] + self.suffix, 0, self.slot_ms, "renew"]),
                [SLOT])
