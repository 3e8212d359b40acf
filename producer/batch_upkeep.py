"""What runs beside a gateway's batch passes (producer/batch_driver.py): the webhook deliveries,
in a task of their own, and the count of each batch's steps that raised in a row."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

from .batch_store import BatchStore
from .batch_webhooks import Webhooks

log = logging.getLogger("genpool.gateway")
# a batch whose step raises this many passes in a row, over at least this long, fails
MAX_STEP_FAILURES, STEP_FAILURES_S = 10, 60.0


class Deliveries:
    """One pass over the due webhook events at a time, beside the batches' passes, never in them:
    a receiver that hangs would hold every batch of the gateway for its timeout."""

    def __init__(self, webhooks: Optional[Webhooks], batches: BatchStore):
        self.webhooks, self.batches = webhooks, batches
        self.task: Optional[asyncio.Task] = None

    def start(self) -> None:
        if self.webhooks is not None and (self.task is None or self.task.done()):
            self.task = asyncio.create_task(self._pass(self.webhooks))

    async def _pass(self, webhooks: Webhooks) -> None:
        try:
            await webhooks.deliver_due(self.batches)
        except Exception:  # noqa: BLE001 - the next pass tries again
            log.exception("batch webhooks: a delivery pass failed")

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        if self.webhooks is not None:
            await self.webhooks.close()


class StepFailures:
    """Per batch, its steps that raised in a row on this gateway (a step that raises for a reason
    of the batch's own, its stored input or record, raises again every pass). A count and a
    time both: ten passes take 2.5 s, and a lost cluster connection can surface as a TypeError."""

    def __init__(self, most: int = MAX_STEP_FAILURES, over_s: float = STEP_FAILURES_S):
        self.most, self.over_s = most, over_s
        self.since: dict[str, tuple[int, float]] = {}  # batch id -> (failed steps, first at)

    def ok(self, bid: str) -> None:
        self.since.pop(bid, None)

    def failed(self, bid: str) -> bool:
        """One more step of `bid` raised: whether the batch is to fail now."""
        n, first = self.since.get(bid, (0, time.monotonic()))
        self.since[bid] = (n + 1, first)
        if n + 1 >= self.most and time.monotonic() - first >= self.over_s:
            del self.since[bid]
            return True
        return False

    def keep_only(self, active: list[str]) -> None:
        """Forget the batches that left the active set (ended here or elsewhere)."""
        for bid in set(self.since) - set(active):
            del self.since[bid]
