"""Prompt log-probabilities (SamplingParams.prompt_logprobs; the gateway's `echo`): each prompt
token after the first, scored by the logits of the row before it, in the prefill the request runs
anyway. A request that does not ask pays nothing: its rows are pruned at the last layer as before.

Which rows a step keeps for a sequence that scores prompt tokens (Sequence.prompt_score_rows):
every row from the first position to score to the end of its chunk (engine/step_rows.py); the
first len(score) of them score, the last is also the sampled row when the chunk ends the prompt.
Such a sequence takes no prefix-cache hit (scheduler): a cached block's rows were never computed.
"""
from __future__ import annotations

import torch

PROMPT_CHUNK_ROWS = 256  # rows log-softmaxed at once: bounds the temporaries for long prompts


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
