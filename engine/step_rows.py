"""Which rows of a step's flat batch come back from the model, and whose they are.

Usually one per sequence whose step ends its known tokens: its last row, which the sampler
reads. Two kinds of sequence keep more, always trailing rows of their chunk (the attention
kernel places a sequence's queries at its last positions):
  - one that scores its prompt (SamplingParams.prompt_logprobs, engine/prompt_logprobs.py):
    every row from the first prompt position it scores this step;
  - one that verifies a speculative draft (engine/speculative.py): its last known token and
    the k drafted ones, k + 1 rows.
The runner (model_runner.prepare) and the engine (split) read the same layout, computed before
the scheduler's update moves the counters.
"""
from __future__ import annotations

import torch


def row_layout(seq, n: int) -> tuple[range, int, int]:
    """(positions whose rows score a prompt token, rows the sampler reads (0, 1, or 1 + the
    draft's length), rows kept in all)."""
    end = seq.num_computed_tokens + n
    sampled = end - seq.num_tokens + 1 if end >= seq.num_tokens else 0
    score = seq.prompt_score_rows(n)
    return score, sampled, (end - score.start) if score else sampled


def split(scheduled, logits: torch.Tensor) -> tuple[list, list]:
    """logits [kept rows, V] (model_runner.execute) -> per scheduled entry: (its prompt-scoring
    rows [k, V] or None) and (its sampled rows [m, V], m = 1 + draft, or None)."""
    scores, samples, at = [], [], 0
    for seq, n in scheduled:
        score, sampled, kept = row_layout(seq, n)
        scores.append(logits[at:at + len(score)] if score else None)
        samples.append(logits[at + kept - sampled:at + kept] if sampled else None)
        at += kept
    if at != logits.shape[0]:
        raise RuntimeError(f"the step returned {logits.shape[0]} logit rows for {at} kept ones")
    return scores, samples
