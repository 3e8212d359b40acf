"""Prompt log-probabilities (SamplingParams.prompt_logprobs; the gateway's `echo`): each prompt
token after the first, scored by the logits of the row before it, in the prefill the request runs
anyway. A request that does not ask pays nothing: its rows are pruned at the last layer as before.

Which rows a step keeps for a sequence (row_layout): when it scores prompt tokens this step
(Sequence.prompt_score_rows), every row from the first position to score to the end of its chunk
(trailing rows: the attention kernel places a sequence's queries at its last positions); the
first len(score) of them score, and the last is also the sampled row when the chunk ends the
known tokens. Otherwise only the sampled row, if any. The runner (model_runner.prepare) and the
engine (split) read the same layout, computed before the scheduler's update moves the counters.
Such a sequence takes no prefix-cache hit (scheduler): a cached block's rows were never computed.
"""
from __future__ import annotations

import torch

PROMPT_CHUNK_ROWS = 256  # rows log-softmaxed at once: bounds the temporaries for long prompts


def row_layout(seq, n: int) -> tuple[range, bool, int]:
    """(positions whose rows score a prompt token, is the last row sampled, rows kept in all)."""
    end = seq.num_computed_tokens + n
    sampled = end == seq.num_tokens
    score = seq.prompt_score_rows(n)
    return score, sampled, (end - score.start) if score else int(sampled)


def split(scheduled, logits: torch.Tensor) -> tuple[list, list]:
    """logits [kept rows, V] (model_runner.execute) -> per scheduled entry: (its prompt-scoring
    rows [k, V] or None) and (its sampled row [V] or None)."""
    scores, samples, at = [], [], 0
    for seq, n in scheduled:
        score, sampled, kept = row_layout(seq, n)
        scores.append(logits[at:at + len(score)] if score else None)
        samples.append(logits[at + kept - 1] if sampled else None)
        at += kept
    if at != logits.shape[0]:
        raise RuntimeError(f"the step returned {logits.shape[0]} logit rows for {at} kept ones")
    return scores, samples


def score(seq, n: int, rows: torch.Tensor, top: int) -> list[dict[int, float]]:
    """One {token id: logprob} map per scored position: the prompt token that follows it, and the
    `top` most likely ids (the model's raw distribution: no penalty, temperature or bias applies
    to a prompt). Advances seq.prompt_scored."""
    positions = seq.prompt_score_rows(n)
    targets = torch.tensor(seq.token_ids[positions.start + 1:positions.stop + 1])
    out: list[dict[int, float]] = []
    for lo in range(0, rows.shape[0], PROMPT_CHUNK_ROWS):
        logp = torch.log_softmax(rows[lo:lo + PROMPT_CHUNK_ROWS].float(), dim=-1)
        tgt = targets[lo:lo + PROMPT_CHUNK_ROWS]
        picked = logp.gather(1, tgt.unsqueeze(1)).squeeze(1).tolist()
        ids = tgt.tolist()
        if top > 0:
            vals, alt = torch.topk(logp, min(top, logp.shape[-1]), dim=-1)
            for t, lp, vs, ks in zip(ids, picked, vals.tolist(), alt.tolist()):
                d = dict(zip(ks, vs))
                d[t] = lp
                out.append(d)
        else:
            out.extend({t: lp} for t, lp in zip(ids, picked))
    seq.prompt_scored = positions.stop
    return out
