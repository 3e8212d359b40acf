"""Fault isolation: a model step that raised runs again in halves until the request(s) that make it
fail are alone; those fail, everyone else's logits come back (docs/design.md, issue 16's promise:
one caller's request cannot hurt anyone else's)."""
from __future__ import annotations

import logging
from collections.abc import Container
from typing import Callable

import torch

from genpool.engine import step_rows
from genpool.engine.scheduler import SchedulerOutput
from genpool.engine.sequence import Sequence
from genpool.engine.step_logits import StepLogits

log = logging.getLogger("genpool.engine")

Scheduled = list[tuple[Sequence, int]]
Execute = Callable[[Scheduled, list], torch.Tensor]  # ModelRunner.execute(scheduled, block_copies)


def bisect(execute: Execute, scheduled: Scheduled, exc: Exception | None,
           fail: Callable[[Sequence, Exception], None]) -> list[tuple[Scheduled, list]]:
    """[(part, [(prompt-scoring rows or None, sampled logits row or None) per (seq, n)])] for
    the parts that ran (engine/step_rows.py's split); `fail(seq, exc)` for each
    request that fails on its own. `exc` is the failure of `scheduled` as a whole, if known.
    Block copies were applied by the first try: never passed again."""
    if exc is None:
        try:
            logits = execute(scheduled, [])
        except Exception as e:  # noqa: BLE001 - whatever it is, it must not fail the whole batch
            exc = e
        else:
            scores, rows = step_rows.split(scheduled, logits)
            return [(scheduled, list(zip(scores, rows)))]
    if len(scheduled) == 1:
        seq = scheduled[0][0]
        log.error("request %s fails the model step on its own: %s: %s", seq.request_id,
                  type(exc).__name__, exc)
        fail(seq, exc)
        return []
    mid = len(scheduled) // 2
    return bisect(execute, scheduled[:mid], None, fail) + bisect(execute, scheduled[mid:], None, fail)


def isolate(execute: Execute, sched: SchedulerOutput, exc: Exception,
            fail: Callable[[Sequence, Exception], None], live: Container[str]) -> StepLogits:
    """The forward pass of `sched` raised `exc`: bisect fails the request(s) that make it fail on
    their own; sched.scheduled and sched.sampling are narrowed to everyone else (`live`: the
    engine's request ids, read after the failures left it), whose logits come back."""
    log.warning("engine step failed for a batch of %d (%s: %s); isolating the cause",
                len(sched.scheduled), type(exc).__name__, exc)
    parts = bisect(execute, sched.scheduled, exc, fail)
    kept = [(seq, n, score, rows) for part, per in parts
            for (seq, n), (score, rows) in zip(part, per) if seq.request_id in live]
    sched.scheduled = [(seq, n) for seq, n, _, _ in kept]
    sched.sampling = [seq for seq, _, _, rows in kept if rows is not None]
    return StepLogits([score for _, _, score, _ in kept], rows=[rows for _, _, _, rows in kept])
