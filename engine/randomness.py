"""Counter-based sampling randomness: the draw at decode step k is a pure function of its key.

A sampled token is chosen by inverse-CDF sampling with ONE uniform number per row and step:
    u = counter_uniform(seed, index, step)   # seed: the request's; index: which of its n
                                             # completions; step: tokens that completion already has
    token = the first id whose cumulative probability exceeds u * total
There is no generator state to carry, so a completion's k-th draw is the same whether it ran alone,
in any batch, after a preemption (recompute), or on another worker that resumed it after k tokens
(engine/resume.py): the resumed completion's step counter starts at the resumed length.

`counter_uniform` is SplitMix64's finaliser chained over the three key words (each word mixed in
before the next, so (s, i, k) and (s, k, i) differ): a counter-based generator in the sense of
Salmon et al. (Philox and SplitMix are both of that family), cheap enough to run in Python per row.
One uniform per row is also cheaper than torch.multinomial, which draws one exponential per
vocabulary entry.
"""
from __future__ import annotations

import math

import torch

_M64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment (2^64 / golden ratio)


def _mix64(z: int) -> int:
    """SplitMix64's output function: a bijection on 64-bit words with full avalanche."""
    z = (z + _GAMMA) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def counter_bits(seed: int, index: int, step: int) -> int:
    """64 random bits that depend only on (seed, index, step)."""
    z = _mix64(seed & _M64)
    z = _mix64(z ^ (index & _M64))
    return _mix64(z ^ (step & _M64))


def counter_uniform(seed: int, index: int, step: int) -> float:
    """A uniform float in [0, 1) with 53 random bits, from (seed, index, step) alone."""
    return (counter_bits(seed, index, step) >> 11) * (1.0 / (1 << 53))


def sample_inverse_cdf(probs: torch.Tensor, u: float) -> int:
    """The token whose cumulative-probability interval holds u * total (probs: 1-D, >= 0).

    The cumulative sum is in float64 so that the 49k-entry sum of a real vocabulary loses no
    probability mass to rounding; searchsorted(right=True) returns the first index whose cumulative
    mass exceeds the target, which therefore has a probability > 0.
    """
    cdf = torch.cumsum(probs, dim=0, dtype=torch.float64)
    total = float(cdf[-1])
    target = min(u * total, math.nextafter(total, 0.0))  # u * total may round up to total
    idx = int(torch.searchsorted(cdf, torch.tensor([target], dtype=torch.float64,
                                                   device=cdf.device), right=True))
    return min(idx, probs.shape[0] - 1)
