"""From parsed entries to engine requests: the ownership check, then add_request.

Every entry ends in exactly one of: running in the engine, an error on its job's stream (acked),
a dead letter (acked), or a silent ack (a duplicate of a job id another entry owns, or a job that
already finished).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Optional

from schemas import ErrorEvent, JobRequest

from .intake import Entry, Parsed, parse_entry
from .jobstate import InFlight
from .outbox import Outbox
from .streams import CLAIM_LUA, s

log = logging.getLogger("genpool.worker")


@dataclass
class Verdict:
    parsed: Parsed
    kind: str  # run | check | duplicate | finished | cancelled
    attempt: int = 1


def to_engine_prompt(engine, req: JobRequest) -> dict:
    """Token ids exactly as LLM.generate / LLM.chat would build them (parity with offline runs),
    computed here so the worker knows the prompt length before admitting."""
    if req.messages is not None:
        msgs = [m.model_dump() for m in req.messages]
        text = engine.apply_chat_template(msgs)
        ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        text = req.prompt
        ids = engine.tokenizer(text)["input_ids"]
    return {"prompt": text, "prompt_token_ids": list(ids)}


def make_params(req: JobRequest):
    from engine import SamplingParams  # the engine's own validation has the last word

    return SamplingParams(**req.sampling_kwargs())


class Admitter:
    def __init__(self, r, keys, worker_name: str, served_models: frozenset[str],
                 outbox: Outbox, max_deliveries: int, job_ttl_s: int):
        self.r, self.keys, self.name = r, keys, worker_name
        self.served, self.outbox = served_models, outbox
        self.max_deliveries, self.job_ttl_s = max_deliveries, job_ttl_s
        self._claim = r.register_script(CLAIM_LUA)

    def verdicts(self, entries: list[Entry]) -> list[Verdict]:
        """Parse every entry, then check ownership of all job ids in one round trip."""
        parsed = [parse_entry(e, self.served) for e in entries]
        with_id = [p for p in parsed if p.job_id and p.entry.deliveries <= self.max_deliveries]
        pipe = self.r.pipeline(transaction=False)
        now = f"{time.time():.6f}"
        for p in with_id:
            self._claim(keys=[self.keys.job(p.job_id)], client=pipe,
                        args=[p.entry.entry_id, self.name, now, self.job_ttl_s,
                              "run" if p.ok else "check"])
        answers = dict(zip(map(id, with_id), pipe.execute() if with_id else []))
        out = []
        for p in parsed:
            kind, detail = [s(x) for x in answers.get(id(p), (b"dead", b""))]
            out.append(Verdict(p, kind, int(detail) if kind == "run" else 1))
        return out

    def settle(self, v: Verdict) -> Optional[JobRequest]:
        """Handle every verdict but `run`; returns the request when it should be started."""
        p, e = v.parsed, v.parsed.entry
        if v.kind == "dead":  # no job id, or delivered too often
            reason = p.dead_reason or (f"delivered {e.deliveries} times (max "
                                       f"{self.max_deliveries}): its workers died or stalled")
            log.warning("dead-lettering %s %s: %s", e.stream, e.entry_id, reason)
            self.outbox.dead(e, reason, p.job_id if p.dead_reason is None else None)
        elif v.kind in ("duplicate", "finished"):
            log.info("job %s (%s): %s, acknowledging without running", p.job_id, e.entry_id,
                     v.kind)
            self.outbox.ack(e)
        elif v.kind == "cancelled":
            self.outbox.error(p.job_id, e, ErrorEvent(code="cancelled",
                                                      message="cancelled before it started"))
        elif v.kind == "check":
            log.info("rejecting job %s: %s", p.job_id, p.error.message)
            self.outbox.error(p.job_id, e, p.error)
        elif p.req.deadline is not None and p.req.deadline < time.time():
            self.outbox.error(p.job_id, e, ErrorEvent(
                code="expired", message=f"deadline {p.req.deadline:.3f} passed "
                                        f"{time.time() - p.req.deadline:.3f} s before it started"))
        else:
            return p.req
        return None

    def start(self, engine, v: Verdict) -> Optional[InFlight]:
        """add_request; a request the engine refuses becomes an invalid_request error."""
        req, e = v.parsed.req, v.parsed.entry
        try:
            prompt = to_engine_prompt(engine, req)
            engine.add_request(req.id, prompt, make_params(req), priority=req.priority)
        except ValueError as exc:
            self.outbox.error(req.id, e, ErrorEvent(code="invalid_request", message=str(exc)))
            return None
        except Exception as exc:  # an engine bug must not take the worker down
            log.exception("engine refused job %s", req.id)
            self.outbox.error(req.id, e, ErrorEvent(code="internal",
                                                    message=f"{type(exc).__name__}: {exc}"))
            return None
        job = InFlight(req=req, entry=e, attempt=v.attempt, admitted_at=time.time(),
                       prompt_tokens=len(prompt["prompt_token_ids"]))
        if v.attempt > 1 or e.deliveries > 1:
            self.outbox.restart(req.id, f"rerun (attempt {v.attempt}) after its worker was lost",
                                v.attempt)
        return job


def blocks_needed(job: InFlight, block_size: int) -> int:
    """Upper bound on the KV blocks a job can hold (prefix sharing only lowers it)."""
    return job.req.n * math.ceil((job.prompt_tokens + job.req.max_tokens) / block_size)


def free_capacity(stats: dict, inflight: list[InFlight], max_seqs: int, kv_total: int,
                  block_size: int) -> int:
    """Jobs that still fit: free sequence slots (n per job), and KV blocks for the worst case of
    the jobs held (sized by their average, since unread jobs' sizes are unknown)."""
    seqs = sum(j.req.n for j in inflight)
    slots = min(stats["free_seq_slots"], max_seqs - seqs)
    held = [blocks_needed(j, block_size) for j in inflight]
    per_job = max(1, sum(held) // len(held)) if held else 1
    kv_room = (kv_total - sum(held)) // per_job
    return max(0, min(slots, kv_room))
