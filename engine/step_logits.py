"""One forward pass's logits, sorted by whose rows they are, for the rest of the engine step.

The runner returns the kept rows of the whole batch (engine/step_rows.py's layout). The step needs
them in two shapes: prompt-scoring rows per scheduled entry (prompt_logprobs) and the sampler's
input, one row per sampling sequence plus, for a sequence that verifies a draft, all its rows.
`StepLogits` carries them between the forward pass (or fault isolation, engine/isolation.py) and
the sampler; in the usual step nobody scores or verifies, and the runner's tensor goes to the
sampler as it is, with no per-entry slicing (the check is all such a step pays).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from genpool.engine import prompt_logprobs, step_rows
from genpool.engine.request import Request
from genpool.engine.sequence import Sequence

Scheduled = list[tuple[Sequence, int]]  # SchedulerOutput.scheduled: (sequence, tokens this step)


@dataclass
class StepLogits:
    """Exactly one of `logits` and `rows` is set: `logits` when the runner's rows already are the
    sampler's input (the usual step), `rows` when some entry keeps more than its one row."""
    scores: list[torch.Tensor | None]  # per scheduled entry: its prompt-scoring rows [k, V], or None
    logits: torch.Tensor | None = None  # one row per sampling sequence, in order
    rows: list[torch.Tensor | None] | None = None  # per entry: its sampled rows [1 + draft, V], or None

    def for_sampler(self, scheduled: Scheduled, vocab_size: int
                    ) -> tuple[torch.Tensor, dict[Sequence, torch.Tensor]]:
        """(one logits row per sampling sequence, {seq: its rows} for those that verify a draft).
        `scheduled`: the entries these rows are for (narrowed by fault isolation, if it ran)."""
        if self.rows is None:  # the usual step: every row is a sampled one
            return self.logits, {}
        drafts = {seq: r for (seq, _), r in zip(scheduled, self.rows)
                  if r is not None and r.shape[0] > 1}
        first = [r[0] for r in self.rows if r is not None]
        return (torch.stack(first) if first else torch.empty(0, vocab_size)), drafts


def split(scheduled: Scheduled, logits: torch.Tensor) -> StepLogits:
    """The runner's rows -> StepLogits; per-entry slicing only when some entry scores its prompt
    or verifies a draft."""
    if not any(seq.draft or seq.prompt_score_rows(n) for seq, n in scheduled):
        return StepLogits([None] * len(scheduled), logits=logits)
    scores, rows = step_rows.split(scheduled, logits)
    return StepLogits(scores, rows=rows)


def score_prompts(scheduled: Scheduled, scores: list[torch.Tensor | None],
                  requests: Mapping[str, Request]) -> None:
    """Each entry's prompt-scoring rows -> its request's prompt_logprobs (engine/prompt_logprobs.py);
    a request that failed meanwhile (gone from `requests`) is skipped."""
    for (seq, n), rows in zip(scheduled, scores):
        req = requests.get(seq.request_id)
        if rows is not None and req is not None:
            req.prompt_logprobs += prompt_logprobs.score(seq, n, rows, req.params.prompt_logprobs)
