"""Turn one row of logits per sequence into the next token (vLLM's processing order).

Per row: min_tokens masking -> repetition penalty -> presence/frequency penalties -> logit bias
-> greedy argmax (temperature 0) or temperature -> top_k -> top_p -> min_p -> sample
(engine/randomness.py).
Logprobs (when asked) come from log_softmax of the RAW logits, before any of the above.

A seeded row's draw is counter-based: one uniform from (seed, completion index, step), the step
being the number of output tokens the row already has (engine/randomness.py). The sampled token
therefore depends only on the row's own logits and that key: never on the other rows in the batch,
on preemption, or on which worker runs it (a resumed completion continues at its step).

Non-finite values (a model that overflowed, parameters that pushed a logit to inf) are caught per
row: that row gets token -1 and an entry in `Sampler.row_errors`, and every other row is sampled
as usual, so one poisoned request can never take its batch (or its worker) down with it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .outputs import RequestError
from .randomness import counter_uniform, sample_inverse_cdf
from .sampling_params import SamplingParams

FAILED = -1  # the token of a row that could not be sampled (see Sampler.row_errors)


@dataclass
class SampleRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None  # None: the Sampler's shared generator draws (not reproducible by key)
    eos_token_ids: tuple[int, ...] = ()  # banned while min_tokens is not reached
    index: int = 0  # which of the request's n completions: part of the counter's key


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def _rows(idx: list[int], logits: torch.Tensor) -> torch.Tensor:
    # index_select with a tensor: logits[list] takes torch's slow advanced-indexing path on CPU
    return torch.tensor(idx, dtype=torch.long, device=logits.device)


def _is_plain_greedy(row: SampleRow) -> bool:
    p = row.params
    return (p.is_greedy and not p.needs_processing
            and len(row.output_token_ids) >= p.min_tokens)


# ---- logits processors (each works on one row: a 1-D float32 tensor, modified in place) -------
def apply_min_tokens(logits: torch.Tensor, row: SampleRow) -> None:
    """While fewer than min_tokens were generated, forbid eos and the stop token ids."""
    p = row.params
    if len(row.output_token_ids) >= p.min_tokens:
        return
    banned = [*p.stop_token_ids, *row.eos_token_ids]
    banned = [t for t in banned if 0 <= t < logits.shape[-1]]
    if banned:
        logits[torch.tensor(banned, device=logits.device)] = float("-inf")


def apply_logit_bias(logits: torch.Tensor, bias: dict[int, float] | None) -> None:
    """OpenAI's logit_bias: add each value to its token's logit (ids checked at add_request)."""
    if bias:
        idx = torch.tensor(list(bias), device=logits.device)
        logits.index_add_(0, idx, torch.tensor(list(bias.values()), device=logits.device,
                                               dtype=logits.dtype))


def apply_repetition_penalty(logits: torch.Tensor, token_ids: list[int], penalty: float) -> None:
    """HF/vLLM semantics: for every token seen, logit > 0 -> logit / p, else logit * p."""
    if penalty == 1.0 or not token_ids:
        return
    idx = torch.tensor(sorted(set(token_ids)), device=logits.device, dtype=torch.long)
    vals = logits[idx]
    logits[idx] = torch.where(vals > 0, vals / penalty, vals * penalty)


def apply_presence_frequency(logits: torch.Tensor, output_ids: list[int],
                             presence: float, frequency: float) -> None:
    """OpenAI semantics over generated tokens: logit -= presence * [count>0] + frequency * count."""
    if (presence == 0.0 and frequency == 0.0) or not output_ids:
        return
    ids = torch.tensor(output_ids, device=logits.device, dtype=torch.long)
    counts = torch.bincount(ids, minlength=logits.shape[-1])[: logits.shape[-1]].to(logits.dtype)
    logits -= frequency * counts + presence * (counts > 0).to(logits.dtype)


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability mass reaches p."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = mass_before >= p
    drop_sorted[0] = False  # always keep the most likely token
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's probability."""
    if min_p <= 0.0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


class _NonFinite(Exception):
    """A row's processed logits or probabilities went non-finite."""


_MODEL_NONFINITE = RequestError("internal", "the model produced non-finite logits (nan or inf) "
                                            "for this request")


def _parameters_fault(raw: torch.Tensor, row: SampleRow) -> RequestError:
    p = row.params
    if bool(torch.isneginf(raw).all()) or len(row.output_token_ids) < p.min_tokens:
        return RequestError("invalid_request", (
            "no token is left to sample: the constraint, logit_bias and, before min_tokens, the "
            f"banned end-of-text and stop_token_ids forbid every token (min_tokens="
            f"{p.min_tokens}, stop_token_ids={list(p.stop_token_ids)[:8]})"))
    return RequestError("invalid_request", (
        "the sampling parameters made this request's probabilities non-finite "
        f"(temperature={p.temperature}, repetition_penalty={p.repetition_penalty}, "
        f"presence_penalty={p.presence_penalty}, frequency_penalty={p.frequency_penalty})"))


class Sampler:
    """`sampler(logits [N, V], rows) -> (token ids, logprob dicts or None)`."""

    def __init__(self, generator: torch.Generator | None = None):
        # draws for rows without a seed (the engine gives every sampled row one); None means
        # torch's default generator
        self.generator = generator
        # row index -> why it got no token (FAILED), for the last call only
        self.row_errors: dict[int, RequestError] = {}

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow], raw: torch.Tensor | None = None
                 ) -> tuple[list[int], list[dict[int, float] | None]]:
        """`raw`: the same rows before structured outputs' masks; logprobs come from it."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [num_rows={len(rows)}, vocab], "
                             f"got {tuple(logits.shape)}")
        logits = logits.float()
        tokens: list[int] = [0] * len(rows)
        self.row_errors = {}
        plain = [i for i, r in enumerate(rows) if _is_plain_greedy(r)]
        if plain:  # the common case: one argmax for all plain-greedy rows (no copy when that is every row)
            x = logits if len(plain) == len(rows) else logits.index_select(0, _rows(plain, logits))
            idx = x.argmax(dim=-1)
            # argmax picks a NaN or +inf when the row has one: checking the picked values alone
            # finds every non-finite row at the cost of N reads
            finite = torch.isfinite(x.gather(1, idx.unsqueeze(1))).squeeze(1).tolist()
            for i, t, ok in zip(plain, idx.tolist(), finite):
                tokens[i] = t if ok else self._fail(i, _MODEL_NONFINITE)
        plain_set = set(plain)
        for i, row in enumerate(rows):
            if i not in plain_set:
                tokens[i] = self._guarded_row(i, logits[i], row)
        return tokens, self._logprobs(logits if raw is None else raw.float(), rows, tokens)

    def _fail(self, i: int, error: RequestError) -> int:
        self.row_errors[i] = error
        return FAILED

    def _guarded_row(self, i: int, raw: torch.Tensor, row: SampleRow) -> int:
        try:
            tok = self._sample_row(raw.clone(), row)
        except _NonFinite:  # the model's fault, or (despite the bounds) the parameters'?
            # (-inf is a mask's: a constraint's, or logit_bias -100; NaN or +inf the model's)
            if bool(torch.isnan(raw).any() or torch.isposinf(raw).any()):
                return self._fail(i, _MODEL_NONFINITE)
            return self._fail(i, _parameters_fault(raw, row))
        except (RuntimeError, ValueError, IndexError) as exc:  # never the whole batch's problem
            return self._fail(i, RequestError("internal", f"sampling failed for this request: "
                                                          f"{type(exc).__name__}: {exc}"))
        return tok

    def _sample_row(self, logits: torch.Tensor, row: SampleRow) -> int:
        token, probs = self.distribution(logits, row)
        return token if probs is None else sample_inverse_cdf(probs, self.uniform(row))

    def distribution(self, logits: torch.Tensor, row: SampleRow
                     ) -> tuple[int | None, torch.Tensor | None]:
        """The row's processed distribution (logits modified in place): (its argmax, None) when
        greedy, else (None, unnormalized probabilities). Raises _NonFinite when it is not finite
        (engine/speculative.py verifies drafts with it)."""
        p = row.params
        apply_min_tokens(logits, row)
        apply_repetition_penalty(logits, row.prompt_token_ids + row.output_token_ids,
                                 p.repetition_penalty)
        apply_presence_frequency(logits, row.output_token_ids,
                                 p.presence_penalty, p.frequency_penalty)
        apply_logit_bias(logits, p.logit_bias)
        if p.is_greedy:
            tok = int(logits.argmax())
            if not -float("inf") < float(logits[tok]) < float("inf"):
                raise _NonFinite()
            return tok, None
        logits = logits / p.temperature
        logits = apply_top_k(logits, p.top_k)
        logits = apply_top_p(logits, p.top_p)
        logits = apply_min_p(logits, p.min_p)
        probs = torch.softmax(logits, dim=-1)
        total = float(probs.sum())  # one pass: nan or inf anywhere makes the sum non-finite
        if not 0.0 < total < float("inf"):
            raise _NonFinite()
        return None, probs

    def uniform(self, row: SampleRow) -> float:
        """The row's one uniform for this step: keyed by (seed, index, step) when seeded."""
        if row.seed is not None:
            return counter_uniform(row.seed, row.index, len(row.output_token_ids))
        return float(torch.rand((), generator=self.generator))

    @staticmethod
    def _logprobs(logits: torch.Tensor, rows: list[SampleRow], tokens: list[int]
                  ) -> list[dict[int, float] | None]:
        want = [i for i, r in enumerate(rows)
                if r.params.logprobs is not None and tokens[i] != FAILED]
        out: list[dict[int, float] | None] = [None] * len(rows)
        if not want:
            return out
        # every row asking (the usual batch of one kind of job): no copy of the [N, V] logits
        # (index_select was a third of this method's time at 48 rows x 49,152)
        x = logits if len(want) == len(rows) else logits.index_select(0, _rows(want, logits))
        logp = torch.log_softmax(x, dim=-1)
        k_max = min(max(rows[i].params.logprobs for i in want), logp.shape[-1])
        top_vals, top_ids = (torch.topk(logp, k_max, dim=-1) if k_max > 0 else (None, None))
        sampled = logp.gather(1, torch.tensor([tokens[i] for i in want],
                                              device=logp.device).unsqueeze(1))
        sampled = sampled.squeeze(1).tolist()
        top_vals = top_vals.tolist() if top_vals is not None else None
        top_ids = top_ids.tolist() if top_ids is not None else None
        for j, i in enumerate(want):
            k = rows[i].params.logprobs
            d = {} if k == 0 else dict(zip(top_ids[j][:k], top_vals[j][:k]))
            d[tokens[i]] = sampled[j]
            out[i] = d
        return out
