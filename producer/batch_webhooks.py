"""Signed webhooks when a batch ends (completed, failed, expired, cancelled), sent by the
gateways' batch drivers (producer/batch_driver.py).

The event is OpenAI's: `{"id": "evt_...", "object": "event", "created_at", "type":
"batch.completed", "data": {"id": "batch_..."}}`, signed as OpenAI signs them (the Standard
Webhooks scheme): headers `webhook-id`, `webhook-timestamp` and `webhook-signature: v1,<base64
HMAC-SHA256 of "<id>.<timestamp>.<body>">`, keyed by the secret (`whsec_<base64>` or any text).

One event per batch: its id is derived from the batch's, so a receiver recognises a repeat.
Delivery state lives in Redis (`Keys.batch_webhook`, `Keys.webhooks_due`): one sender at a time
holds a claim (schemas/batch_scripts.py), a failed try is retried with doubling delays, and after
`tries` failures the event is dead-lettered (`Keys.webhooks_dead`) and logged.
"""
from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import time
from dataclasses import dataclass

import httpx

from genpool.schemas import Keys
from genpool.schemas.batch_scripts import WEBHOOK_CLAIM_LUA, WEBHOOK_SETTLE_LUA
from genpool.schemas.batches import (
    BATCH_RETENTION_S,
    WEBHOOK_BACKOFF_S,
    WEBHOOK_MAX_DELAY_S,
    WEBHOOK_TIMEOUT_S,
    WEBHOOK_TRIES,
    BatchView,
)
from genpool.schemas.scripting import Script

from .batch_lines import ident
from .batch_store import BatchStore

log = logging.getLogger("genpool.gateway")
CLAIM, SETTLE = Script(WEBHOOK_CLAIM_LUA), Script(WEBHOOK_SETTLE_LUA)
DUE_PER_PASS = 20


@dataclass
class WebhookOptions:
    url: str
    secret: str
    tries: int = WEBHOOK_TRIES
    backoff_s: float = WEBHOOK_BACKOFF_S
    timeout_s: float = WEBHOOK_TIMEOUT_S

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"a webhook URL is http(s)://... (got {self.url!r})")
        if not self.secret:
            raise ValueError("a webhook needs a secret to sign with (GENPOOL_WEBHOOK_SECRET)")
        if self.tries < 1 or self.backoff_s <= 0 or self.timeout_s <= 0:
            raise ValueError("webhook tries, backoff and timeout must be > 0")


def secret_key(secret: str) -> bytes:
    """The HMAC key: the base64 after `whsec_` (OpenAI's and Standard Webhooks' form), else the
    text's bytes."""
    if secret.startswith("whsec_"):
        return base64.b64decode(secret.removeprefix("whsec_"))
    return secret.encode()


def sign(secret: str, msg_id: str, timestamp: int, body: str) -> str:
    mac = hmac.new(secret_key(secret), f"{msg_id}.{timestamp}.{body}".encode(), hashlib.sha256)
    return "v1," + base64.b64encode(mac.digest()).decode()


def event_of(view: BatchView) -> dict:
    rec = view.record
    return {"id": f"evt_{ident(rec.id)}", "object": "event",
            "created_at": view.stamps.get(f"{view.status}_at", rec.created_at),
            "type": f"batch.{view.status}", "data": {"id": rec.id}}


class Webhooks:
    def __init__(self, r, keys: Keys, options: WebhookOptions, token: str):
        self.r, self.keys, self.options, self.token = r, keys, options, token
        self.http = httpx.AsyncClient(timeout=options.timeout_s)

    async def close(self) -> None:
        await self.http.aclose()

    async def notify(self, bid: str) -> None:
        """The batch ended: its event is due now (once: a repeat finds it pending or done)."""
        await self.r.zadd(self.keys.webhooks_due, {bid: time.time()}, nx=True)
        await self.r.expire(self.keys.webhooks_due, BATCH_RETENTION_S)
        key = self.keys.batch_webhook(bid)
        await self.r.hsetnx(key, "state", "pending")
        await self.r.expire(key, BATCH_RETENTION_S)

    async def deliver_due(self, batches: BatchStore) -> None:
        due = await self.r.zrangebyscore(self.keys.webhooks_due, "-inf", time.time(), start=0,
                                         num=DUE_PER_PASS)
        # side by side: one receiver that hangs costs one timeout, not one per event
        got = await asyncio.gather(*(self.deliver(bid, batches) for bid in due),
                                   return_exceptions=True)
        for bid, err in zip(due, got):
            if isinstance(err, Exception):  # (a lost Redis): its event stays due
                log.warning("batch %s: its webhook delivery failed (%s)", bid, err)

    async def deliver(self, bid: str, batches: BatchStore) -> None:
        claim_ms = int((self.options.timeout_s + 5) * 1000)
        verdict = await CLAIM.acall(self.r, [self.keys.batch_webhook(bid)],
                                    [int(time.time() * 1000), claim_ms, self.token])
        if verdict == "busy":
            return
        view = await batches.get(bid) if verdict == "go" else None
        if view is None:  # delivered, dead, or its batch is gone: nothing left to send
            await self.r.zrem(self.keys.webhooks_due, bid)
            return
        ok = await self.post(event_of(view))
        tries, state = await SETTLE.acall(self.r, [self.keys.batch_webhook(bid)],
                                          [self.token, int(ok), self.options.tries])
        if state == "pending":
            delay = min(WEBHOOK_MAX_DELAY_S, self.options.backoff_s * 2 ** (int(tries) - 1))
            await self.r.zadd(self.keys.webhooks_due, {bid: time.time() + delay}, xx=True)
            return
        await self.r.zrem(self.keys.webhooks_due, bid)
        if state == "dead":
            await self.r.zadd(self.keys.webhooks_dead, {bid: time.time()})
            await self.r.expire(self.keys.webhooks_dead, BATCH_RETENTION_S)
            log.error("batch %s: its webhook failed %s times; dead-lettered", bid, tries)

    async def post(self, event: dict) -> bool:
        body = json.dumps(event, separators=(",", ":"))
        ts = int(time.time())
        headers = {"content-type": "application/json", "webhook-id": event["id"],
                   "webhook-timestamp": str(ts),
                   "webhook-signature": sign(self.options.secret, event["id"], ts, body)}
        try:
            resp = await self.http.post(self.options.url, content=body, headers=headers)
        except httpx.HTTPError as e:
            log.warning("batch webhook %s: %s", event["id"], type(e).__name__)
            return False
        return 200 <= resp.status_code < 300

