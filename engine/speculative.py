"""Speculative decoding with n-gram drafts (vLLM's `ngram` method, prompt lookup): exact.

Proposal: a decoding sequence whose last n tokens (n from prompt_lookup_max down to
prompt_lookup_min) occurred earlier in its own tokens (prompt and output) drafts the k tokens
that followed that occurrence (the most recent one). Summaries, extractions and code edits copy
from their input, so such drafts are often right, and a draft costs no model.

Verification: the step computes the sequence's last token and its k drafts in one forward pass
(k + 1 rows, the K/V of every draft written in the paged cache as it goes) and walks the rows in
order, each through the sampler's own processing (penalties, bias, min_tokens, temperature,
top-k/p, min-p) on the history the row would have had, to the token the sampler would pick there:
the argmax, or the draw keyed by (seed, completion, step) (engine/randomness.py). A draft that
equals it is accepted; the first that does not is replaced by it and ends the walk. The tokens are
therefore the ones decoding without drafts gives, greedy or seeded, token for token; and a draft
token d is accepted with probability p(d), as the standard rule for a point-mass draft does
(coupling the test to the sampler's own draw loses nothing and keeps outputs reproducible).
When every draft is accepted, the last row's token comes for free. Rejected drafts' K/V lie past
num_computed_tokens, where the next steps write over them; their blocks are never hashed into the
prefix cache (BlockManager registers only blocks full of verified tokens).

Drafts are off (turned off by the engine, per step) for a batch of more than
`speculative_max_batch` running sequences: there the extra rows cost more than they save.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from .randomness import sample_inverse_cdf
from .sampler import Sampler, SampleRow


@dataclass(frozen=True)
class SpecConfig:
    """EngineConfig.spec_config(): the defaults and their reasons live on EngineConfig's fields."""
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    max_batch: int  # running sequences above which no sequence drafts
    default_on: bool  # jobs that do not say (speculative=None) draft too: the engine has a method


def propose(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix
    n-gram (n_max down to n_min) of token_ids; [] when none occurs."""
    length = len(token_ids)
    if k < 1 or length < n_min + 1:
        return []
    hay = array("i", token_ids).tobytes()  # C-speed search; ids fit in int32
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        pat = hay[(length - n) * 4:]
        end = (length - 1) * 4  # the occurrence must be followed by at least one token
        pos = hay.rfind(pat, 0, end)
        while pos > 0 and pos % 4:  # matched across token boundaries: look further back
            pos = hay.rfind(pat, 0, pos + len(pat) - 1)
        if pos >= 0 and pos % 4 == 0:
            start = pos // 4 + n
            return token_ids[start:start + k]
    return []


def verify(sampler: Sampler, rows: torch.Tensor, row: SampleRow, draft: list[int]) -> list[int]:
    """rows [len(draft) + 1, V]: row i predicts the token after draft[:i]. Returns the tokens
    to append: the accepted drafts, then one more (the replacement, or the last row's token).
    Each row's token is the sampler's own (argmax, or its counter-keyed draw at that step): a
    draft is accepted where it equals it. Raises when a row's distribution is not finite (the
    caller fails that request alone)."""
    out: list[int] = []
    for i in range(rows.shape[0]):
        here = SampleRow(row.params, row.prompt_token_ids, row.output_token_ids + out, row.seed,
                         row.eos_token_ids, row.index)
        token, probs = sampler.distribution(rows[i].clone(), here)
        if probs is not None:
            token = sample_inverse_cdf(probs, sampler.uniform(here))
        out.append(token)
        if i == len(draft) or token != draft[i]:
            break
    return out


def eligible(seq) -> bool:
    """A decoding sequence whose draft can be verified exactly by the sampler's row processing
    (structured outputs and logprobs keep per-token state the walk does not replay)."""
    p = seq.params
    return (p.speculative is not False and p.structured_outputs is None and p.logprobs is None
            and seq.num_output_tokens >= 1 and seq.pending_forks == 0
            and seq.num_computed_tokens == seq.num_tokens - 1)


class Speculator:
    """The engine's side: drafts before the scheduler runs, verification after the model ran."""

    def __init__(self, config: SpecConfig, max_model_len: int):
        self.config, self.max_model_len = config, max_model_len
        self.drafted = self.accepted = 0  # tokens, for stats

    def draft(self, running: list) -> None:
        """Give each eligible running sequence its draft for the coming step (or none). A job
        asks for drafts with SamplingParams.speculative=True, or gets them by default when the
        engine has a method (default_on); none while the batch is over max_batch."""
        cfg = self.config
        crowded = len(running) > cfg.max_batch
        for seq in running:
            wanted = seq.params.speculative or (seq.params.speculative is None and cfg.default_on)
            if crowded or not wanted or not eligible(seq):
                seq.draft = []
                continue
            room = min(cfg.num_speculative_tokens, seq.params.max_tokens - seq.num_output_tokens - 1,
                       self.max_model_len - seq.num_tokens - 1)
            seq.draft = propose(seq.token_ids, room, cfg.prompt_lookup_min, cfg.prompt_lookup_max)

    def verify(self, sampler: Sampler, drafts: dict, row_of, fail) -> list:
        """SampledTokens for every sequence that verified a draft this step: the accepted draft
        tokens (computed=True: their K/V are in the cache), then one more. `fail(seq, exc)`
        ends a request whose rows cannot be sampled."""
        from .scheduler import SampledToken

        out = []
        for seq, rows in drafts.items():
            try:
                tokens = verify(sampler, rows, row_of(seq), seq.draft[:rows.shape[0] - 1])
            except Exception as exc:  # noqa: BLE001 - that request alone
                fail(seq, exc)
                continue
            self.drafted += rows.shape[0] - 1
            self.accepted += len(tokens) - 1
            out += [SampledToken(seq, t, computed=j < len(tokens) - 1) for j, t in enumerate(tokens)]
        return out
