"""How a batch's lines reach the queue (producer/batch_driver.py): checked all at once, submitted a
window at a time, in an order that serves deadlines and the prefix cache.

- **Expansion** (`validating`): every line is checked; a bad one is answered at once, a good one
  goes to the batch's `lines` hash and its `todo` set, ordered prefix by prefix (a prefix: the
  prompt text's first PREFIX_CHARS characters), each prefix's first line before its others.
- **Feeding** (`in_progress`, every pass): up to `in_flight` lines of a batch are submitted and
  unanswered at once. A batch feeds only while no batch of its tenant whose window ends sooner
  has lines left to submit: across the pool's gateways, the bulk lane serves a tenant's batches earliest
  deadline first (different tenants' batches feed side by side; fair pull shares the workers).
  A prefix's other lines wait for its first line to be computed (answered, or its first token
  PREFIX_GATE_S old, so its worker has published the prefix), then arrive together, and prefix
  routing (workers/router.py) sends them where the prefix is cached. At most twice as many
  prefixes as there are live workers are under way at once, so a prefix's blocks are still
  cached when its other lines run: each document of N x M lines is prefilled about once rather
  than once per worker that happened to pull a line, or again after it was evicted.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from genpool.schemas.batches import PREFIX_CHARS, PREFIX_GATE_S, BatchRecord, BatchView

from . import batch_lines as bl
from .batch_store import batch_ttl_s
from .liveness import live_workers_async
from .openai_format import APIError

if TYPE_CHECKING:
    from .batch_driver import BatchDriver

log = logging.getLogger(__name__)

CHUNK = 500
SCAN = 4  # a feed looks at this many times its room for lines that may go now


def prefix_key(kwargs: dict) -> str:
    # a token-id prompt keys by its ids (all such lines had the key of None otherwise)
    text = kwargs.get("prompt") or json.dumps(kwargs.get("messages") or kwargs.get("prompt_token_ids"),
                                              ensure_ascii=False)
    return hashlib.sha1(text[:PREFIX_CHARS].encode()).hexdigest()


@dataclass
class Checked:
    """One input line after its checks: its job's kwargs and prefix key, or the error it is
    answered with at once."""
    n: int
    obj: dict
    jid: str
    key: str = ""
    error: Optional[APIError] = None


def check_all(bid: str, rec: BatchRecord, lines: list, done: set, live) -> list[Checked]:
    """Every line not yet answered, checked (CPU only: the driver runs it off the event loop,
    which a 50,000-line file of schemas would hold for seconds)."""
    out = []
    for n, obj in lines:
        if obj["custom_id"] in done:
            continue
        jid = bl.line_job_id(bid, obj["custom_id"])
        try:
            out.append(Checked(n, obj, jid, key=prefix_key(bl.to_request(obj, rec, live).kwargs)))
        except APIError as e:
            out.append(Checked(n, obj, jid, error=e))
        except Exception as exc:  # noqa: BLE001 - a line the checks missed fails alone, logged,
            # instead of failing the expansion, which the next tick would retry forever
            log.exception("batch %s line %d could not be read", bid, n)
            out.append(Checked(n, obj, jid, error=APIError(
                500, f"this line could not be read ({type(exc).__name__})", "server_error")))
    return out


async def expand(d: "BatchDriver", bid: str, view: BatchView) -> bool:
    """Check every line not yet answered; False when the input file is gone."""
    rec, ttl, k = view.record, batch_ttl_s(view.record), d.keys
    lines = await d.input_lines(view)
    if lines is None:
        return False
    done = set(await d.r.hkeys(k.batch_done(bid)))
    live = await live_workers_async(d.r, k)
    leads: dict[str, tuple[str, int]] = {}  # prefix -> (job id, rank) of its first line
    entries: dict[str, str] = {}
    order: dict[str, int] = {}
    # order by each line's rank among the lines (< MAX_BATCH_LINES < 2**17), not its line
    # number: blank lines can push numbers past 2**17, where two keys would tie
    for rank, c in enumerate(await d.off_loop(check_all, bid, rec, lines, done, live, bid=bid)):
        if c.error is not None:
            await d.answer(bid, c.obj["custom_id"], c.n, False,
                           bl.http_error(c.jid, c.obj["custom_id"], c.error), "", ttl)
            continue
        lead_id, lead_rank = leads.setdefault(c.key, (c.jid, rank))
        lead = None if lead_id == c.jid else lead_id
        entries[c.jid] = {"n": c.n, "obj": c.obj, "lead": lead, "followers": 0}
        if lead is not None:
            entries[lead]["followers"] += 1
        # a prefix's first line, then its others, prefix after prefix in input order
        order[c.jid] = (lead_rank << 17) + (0 if lead is None else rank)
    ids = list(entries)
    for i in range(0, len(ids), CHUNK):
        chunk = ids[i:i + CHUNK]
        await d.renew(bid)
        await d.r.hset(k.batch_lines(bid), mapping={j: json.dumps(entries[j]) for j in chunk})
        await d.r.zadd(k.batch_todo(bid), {j: order[j] for j in chunk})
    for key in (k.batch_lines(bid), k.batch_todo(bid)):
        await d.r.expire(key, ttl)
    return True


async def first_in_line(d: "BatchDriver", view: BatchView) -> bool:
    """Whether no batch of the same tenant whose window ends sooner still has lines to submit.
    Other tenants' batches feed beside it: the workers' fair pull shares the bulk lane between
    tenants (workers/fair.py), where deadline order would make one tenant's 24-hour batches
    hold back every later tenant's until they were all submitted."""
    k, me = d.keys, view.record
    sooner = [b for b in await d.r.zrangebyscore(k.batches_active, "-inf", f"({me.expires_at}")
              if b != me.id]
    if not sooner:
        return True
    pipe = d.r.pipeline(transaction=False)  # one round trip for all, not two per batch
    for other in sooner:
        pipe.hmget(k.batch(other), "status", "record")
        pipe.zcard(k.batch_todo(other))
    replies = await pipe.execute()
    for (status, raw), todo in zip(replies[0::2], replies[1::2]):
        if status == "in_progress" and raw and todo and \
                BatchRecord.model_validate_json(raw).owner == me.owner:
            return False
    return True


async def feed(d: "BatchDriver", bid: str, view: BatchView, in_flight: int) -> int:
    """Submit what may go now; returns how many lines were submitted."""
    k = d.keys
    room = in_flight - await d.r.scard(k.batch_sent(bid))
    if room <= 0 or not await d.r.zcard(k.batch_todo(bid)) or not await first_in_line(d, view):
        return 0
    picked = await pick(d, bid, room, 2 * max(1, len(await live_workers_async(d.r, k))))
    if not picked:
        return 0
    # sent before submitted: a crash between leaves a sent line with no job, which collect()
    # finds lost and submits (same id); never a job that no one collects
    await d.r.sadd(k.batch_sent(bid), *[j for j, _ in picked])
    await d.r.expire(k.batch_sent(bid), batch_ttl_s(view.record))
    await d.client.submit_many(await d.off_loop(
        lambda: [bl.parse_line_body(x["obj"], view.record).kwargs for _, x in picked]))
    await d.r.zrem(k.batch_todo(bid), *[j for j, _ in picked])
    return len(picked)


async def pick(d: "BatchDriver", bid: str, room: int, open_max: int) -> list[tuple[str, dict]]:
    """Up to `room` lines that may go now, in order. A prefix is open from its first line's
    submission until its last line's: at most `open_max` (twice the live workers) are open at
    once, so a prefix's lines run while its blocks are still cached; a line that shares its
    prefix with no other is never held back."""
    ids = await d.r.zrange(d.keys.batch_todo(bid), 0, room * SCAN - 1)
    ready: dict[str, bool] = {}
    open_now: set[str] = set()  # prefixes (by their first line) with lines left in `todo`
    picked = []
    for jid, info in zip(ids, await d.lines_of(bid, ids)):
        if info is None:
            continue
        lead = info["lead"]
        if lead is None and info["followers"] and jid not in open_now:
            if len(open_now) >= open_max:
                continue  # a new prefix waits until one open now is done
            open_now.add(jid)
            ready[jid] = False  # its others wait for it to be computed
        elif lead is not None:
            open_now.add(lead)
            if lead not in ready:
                ready[lead] = await lead_computed(d, bid, lead)
            if not ready[lead]:
                continue
        picked.append((jid, info))
        if len(picked) >= room:
            break
    return picked


async def lead_computed(d: "BatchDriver", bid: str, lead: str) -> bool:
    """A prefix's first line is answered, or its first token is PREFIX_GATE_S old (a stream
    entry's id starts with its time in ms)."""
    if not await d.r.hexists(d.keys.batch_lines(bid), lead):
        return True
    first = await d.r.xrange(d.keys.events(lead), count=1)
    return bool(first) and int(first[0][0].split("-")[0]) / 1000 <= time.time() - PREFIX_GATE_S
