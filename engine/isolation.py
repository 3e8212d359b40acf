"""Fault isolation: a model step that raised runs again in halves until the request(s) that make it
fail are alone; those fail, everyone else's logits come back (docs/design.md, issue 16's promise:
one caller's request cannot hurt anyone else's)."""
from __future__ import annotations

import logging
from typing import Callable

import torch

from genpool.engine import step_rows
from genpool.engine.sequence import Sequence

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
