"""From parsed entries to engine requests: the ownership check, then add_request.

Every entry ends in exactly one of: running in the engine, an error on its job's stream (acked),
a dead letter (acked), a silent ack (a duplicate of a job id another entry owns, or a job that
already finished), or handed back to the live worker that holds its lease. An entry whose claim
Redis refused (a write refused: OOM, NOREPLICAS) is none of these yet: it is held and claimed
again (workers/custody.py), never dead-lettered for it.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Optional

import redis

from genpool.engine.protocol import EngineStats
from genpool.schemas import ErrorEvent, JobRequest
from genpool.schemas.connection import REDIS_DOWN, queue_script
from genpool.schemas.scripts import CLAIM_LUA
from genpool.workers.intake import Parsed
from genpool.workers.jobstate import InFlight, engine_request_id
from genpool.workers.lease import Fence, new_token
from genpool.workers.outbox import Outbox
from genpool.workers.streams import refused, s

WRITES = ("run", "check", "cancelled", "dead")  # verdicts that hold a lease and write for the job
SOLO_AFTER = 2  # lost-worker batches a job may share before it runs alone (see CLAIM_LUA)

log = logging.getLogger("genpool.worker")


@dataclass
class Verdict:
    parsed: Parsed
    kind: str  # run | check | duplicate | finished | cancelled | dead | leased | refused
    attempt: int = 1
    detail: str = ""
    suspect: int = 0  # how often a worker was lost while it shared that worker's batch
    fence: Optional[Fence] = None  # this attempt's lease (every verdict that writes has one)
    prompt: Optional[dict] = None  # prepared engine prompt (token ids)


def to_engine_prompt(engine, req: JobRequest, tokenizer=None) -> dict:
    """Token ids exactly as LLM.generate / LLM.chat would build them (parity with offline runs),
    computed here so the worker knows the prompt length before admitting."""
    tok = tokenizer or engine.tokenizer
    if req.messages is not None:
        msgs = [m.model_dump() for m in req.messages]
        text = engine.apply_chat_template(msgs)
        ids = tok(text, add_special_tokens=False)["input_ids"]
    else:
        text = req.prompt
        ids = tok(text)["input_ids"]
    return {"prompt": text, "prompt_token_ids": list(ids)}


def make_params(req: JobRequest):
    from genpool.engine import SamplingParams  # the engine's own validation has the last word

    return SamplingParams(**req.sampling_kwargs())


def longest_token_chars(tokenizer) -> Optional[int]:
    """Characters of the longest vocabulary entry (byte-level BPE: one char per byte), so that a
    text longer than max_model_len times this is known to be too long without tokenizing it."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    try:
        return max(map(len, get_vocab())) if get_vocab else None
    except (TypeError, ValueError):
        return None


def prepare(engine, parsed: Parsed, tokenizer=None, max_chars: Optional[int] = None) -> Parsed:
    """Build the engine prompt of a valid request (the slow part of admission: chat template and
    tokenizer, seconds for a megabyte); a failure becomes the job's invalid_request error."""
    req = parsed.req
    if req is None:
        return parsed
    chars = len(req.prompt) if req.prompt is not None else sum(len(m.content)
                                                                 for m in req.messages)
    if max_chars is not None and chars > max_chars:
        return _refuse(parsed, f"prompt is {chars} characters, more than the model's limit of "
                               f"{engine.max_model_len} tokens can hold")
    try:
        parsed.extra["prompt"] = to_engine_prompt(engine, req, tokenizer)
    except Exception as exc:  # noqa: BLE001 - e.g. a chat template refusing the roles
        return _refuse(parsed, f"could not build the prompt: {type(exc).__name__}: {exc}")
    return parsed


def _refuse(parsed: Parsed, message: str) -> Parsed:
    return Parsed(parsed.entry, job_id=parsed.job_id,
                  error=ErrorEvent(code="invalid_request", message=message))


class Admitter:
    def __init__(self, r, keys, worker_name: str, served_models: frozenset[str],
                 outbox: Outbox, max_deliveries: int, job_ttl_s: int, lease_ms: int):
        self.r, self.keys, self.name = r, keys, worker_name
        self.served, self.outbox = served_models, outbox
        self.max_deliveries, self.job_ttl_s, self.lease_ms = max_deliveries, job_ttl_s, lease_ms
        self._claim = r.register_script(CLAIM_LUA)

    def verdicts(self, parsed: list[Parsed]) -> list[Verdict]:
        """Check ownership of all job ids in one round trip (and take a lease on each)."""
        with_id = [p for p in parsed if p.job_id]
        pipe = self.r.pipeline(transaction=False)
        now = f"{time.time():.6f}"
        tokens = {id(p): new_token(self.name) for p in with_id}
        for p in with_id:
            queue_script(pipe, self._claim, [self.keys.job(p.job_id)],
                         [p.entry.entry_id, self.name, now, self.job_ttl_s,
                          "run" if p.ok else "check", tokens[id(p)], self.lease_ms,
                          p.entry.deliveries, self.max_deliveries])
        replies = pipe.execute(raise_on_error=False) if with_id else []
        for x in replies:
            if isinstance(x, REDIS_DOWN):
                raise x  # nothing is settled yet: custody lets every entry go (see admit)
        answers = dict(zip(map(id, with_id), replies))
        out = []
        for p in parsed:
            answer = answers.get(id(p), (b"dead", b"", 0, 0))
            if refused(answer):  # the script wrote nothing (no lease taken): claim it again
                out.append(Verdict(p, "refused", detail=str(answer)))
                continue
            claimed = not isinstance(answer, Exception)
            if not claimed:  # this job alone (e.g. its hash clobbered): dead-letter the entry,
                log.error("job %s: its ownership claim failed: %s", p.job_id, answer)
                answer = (b"dead", f"its job hash cannot be claimed: {answer}", 0, 0)  # unfenced
            kind, detail, attempt, suspect = answer
            kind, attempt = s(kind), int(attempt)
            fence = (Fence(tokens[id(p)], attempt) if claimed and kind in WRITES and id(p) in tokens
                     else None)
            out.append(Verdict(p, kind, attempt, s(detail), int(suspect), fence,
                               p.extra.get("prompt")))
        return out

    def settle(self, v: Verdict) -> Optional[JobRequest]:
        """Handle every verdict but `run`; returns the request when it should be started."""
        p, e = v.parsed, v.parsed.entry
        if v.kind == "dead":  # no job id, or charged too often
            reason = p.dead_reason or v.detail
            log.warning("dead-lettering %s %s: %s", e.stream, e.entry_id, reason)
            self.outbox.dead(e, reason, p.job_id if p.dead_reason is None else None, v.fence)
        elif v.kind in ("duplicate", "finished"):
            log.info("job %s (%s): %s, acknowledging without running", p.job_id, e.entry_id,
                     v.kind)
            self.outbox.ack(e)
        elif v.kind == "leased":  # reclaimed from a live worker: give the entry straight back
            log.info("job %s is leased by live worker %s; handing its entry back", p.job_id,
                     v.detail)
            try:
                self.r.xclaim(e.stream, self.keys.group, v.detail or self.name, 0,
                              [e.entry_id], justid=True)
            except redis.RedisError as exc:  # it stays in our pending list, unheld: reclaimed
                if not (isinstance(exc, REDIS_DOWN) or refused(exc)):  # later; go on with the
                    raise                                              # rest
                log.warning("job %s: hand-back failed (%s)", p.job_id, exc)
        elif v.kind == "refused":  # custody holds the entry and claims it again
            pass
        elif v.kind == "cancelled":
            self.outbox.error(p.job_id, e, ErrorEvent(code="cancelled",
                                                      message="cancelled before it started"),
                              v.fence)
        elif v.kind == "check":
            log.info("rejecting job %s: %s", p.job_id, p.error.message)
            self.outbox.error(p.job_id, e, p.error, v.fence)
        elif p.req.deadline is not None and p.req.deadline < time.time():
            self.outbox.error(p.job_id, e, ErrorEvent(
                code="expired", message=f"deadline {p.req.deadline:.3f} passed "
                                        f"{time.time() - p.req.deadline:.3f} s before it started"),
                v.fence)
        else:
            return p.req
        return None

    def start(self, engine, v: Verdict) -> Optional[InFlight]:
        """add_request; a request the engine refuses becomes an invalid_request error."""
        req, e = v.parsed.req, v.parsed.entry
        engine_id = engine_request_id(req.id)
        try:
            prompt = v.prompt or to_engine_prompt(engine, req)
            engine.add_request(engine_id, prompt, make_params(req), priority=req.priority)
        except ValueError as exc:
            self.outbox.error(req.id, e, ErrorEvent(code="invalid_request", message=str(exc)),
                              v.fence)
            return None
        except Exception as exc:  # an engine bug must not take the worker down
            log.exception("engine refused job %s", req.id)
            self.outbox.error(req.id, e, ErrorEvent(code="internal",
                                                    message=f"{type(exc).__name__}: {exc}"),
                              v.fence)
            return None
        n_prompt = len(prompt["prompt_token_ids"])
        job = InFlight(req=req, entry=e, attempt=v.attempt, admitted_at=time.time(),
                       prompt_tokens=n_prompt, fence=v.fence, engine_id=engine_id,
                       max_len=min(n_prompt + req.max_tokens, engine.max_model_len))
        if v.attempt > 1 or e.deliveries > 1:
            self.outbox.restart(req.id, f"rerun (attempt {v.attempt}) after its worker was lost",
                                v.fence)
        return job


def blocks_needed(job: InFlight, block_size: int) -> int:
    """Upper bound on the KV blocks a job can hold (prefix sharing only lowers it): prompt +
    max_tokens as the engine caps them to the model's length (job.max_len), or a max_tokens far
    beyond it (10**6) would count as more than the whole cache and admit no one else."""
    return job.req.n * math.ceil(job.max_len / block_size)


def free_capacity(stats: EngineStats, inflight: list[InFlight], max_seqs: int, kv_total: int,
                  block_size: int) -> int:
    """Jobs that still fit: free sequence slots (n per job), and KV blocks for the worst case of
    the jobs held (sized by their average, since unread jobs' sizes are unknown)."""
    seqs = sum(j.req.n for j in inflight)
    slots = min(stats.free_seq_slots, max_seqs - seqs)
    held = [blocks_needed(j, block_size) for j in inflight]
    per_job = max(1, sum(held) // len(held)) if held else 1
    kv_room = (kv_total - sum(held)) // per_job
    return max(0, min(slots, kv_room))
