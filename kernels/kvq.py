"""The int8 KV cache's row format (kv_cache_dtype int8), in torch: the reference the C kernels
(cpu_write_kv.c, cpu_decode_attention.c, cpu_prefill_attention.c) match bit for bit.

A cache of int8 holds, per token and kv head, the D quantized elements followed by one fp32 scale per
group of 32 (the last group may be shorter): [blocks, bs, Hkv, D + 4 * ceil(D / 32)]. One tensor per
cache, so every path that moves blocks (copy-on-write, the block tables) works on it unchanged.
Quantization is symmetric per group: scale = max|x| / 127, q = round-half-even(x * (127 / max|x|)),
clamped to +-127 (an all-zero group, or one whose 127 / max|x| is not finite: q 0; a NaN: 0). Groups of 32, not one scale per vector: K has channels
far larger than the rest, and one scale per 64 took SmolLM2's teacher-forced log-probs ~1.4x further
from the fp32 cache's (median 0.0131 against 0.0094 nats, measured). Reading gives (float)q * scale,
one rounding: decode and prefill attention widen alike, so a prompt row's attention still gives the
bits decode gives for the same position.
"""
from __future__ import annotations

import torch

GROUP = 32  # elements per scale


def _groups(head_dim: int) -> int:
    return -(-head_dim // GROUP)


def row_dim(head_dim: int, dtype: torch.dtype) -> int:
    """The cache's last dimension for vectors of head_dim elements."""
    return head_dim + 4 * _groups(head_dim) if dtype == torch.int8 else head_dim


def head_dim(cache: torch.Tensor) -> int:
    """The head size a cache [blocks, bs, Hkv, row] holds (int8: row = D + 4 * ceil(D / 32)); a
    row no head size gives is refused (a kernel would read past the last vector)."""
    if cache.dtype != torch.int8:
        return cache.shape[-1]
    row = cache.shape[-1]
    d = row - 4 * -(-row // (GROUP + 4))  # each group takes GROUP + 4 bytes, the last one r + 4
    if d < 1 or row_dim(d, torch.int8) != row:
        raise ValueError(f"an int8 KV cache row of {row} bytes holds no head size (D + 4 * ceil(D / 32))")
    return d


def _grouped(x: torch.Tensor) -> torch.Tensor:
    """[..., D] fp32 -> [..., groups, 32], the last group zero-padded."""
    d = x.shape[-1]
    pad = _groups(d) * GROUP - d
    return torch.nn.functional.pad(x, (0, pad)).view(*x.shape[:-1], _groups(d), GROUP)


def quantize(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (any float dtype) -> int8 rows [..., D + 4 * ceil(D / 32)]."""
    d = x.shape[-1]
    g = _grouped(x.float())
    amax = g.abs().nan_to_num(nan=0.0, posinf=float("inf")).amax(dim=-1, keepdim=True)  # NaN left out
    scale = amax / 127
    # one division a group, tensor by tensor: `127 / t` is a reciprocal and a product (two
    # roundings), which the C kernel's 127.f / amax is not. 0 where not finite: those elements 0
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / torch.where(amax > 0, amax, 1), 0)
    inv = torch.where(torch.isfinite(inv), inv, 0)
    y = g * inv
    q = torch.where(torch.isnan(y), 0, y).round().clamp(-127, 127)
    out = torch.empty(*x.shape[:-1], row_dim(d, torch.int8), dtype=torch.int8, device=x.device)
    out[..., :d] = q.flatten(-2)[..., :d].to(torch.int8)
    out[..., d:] = scale.squeeze(-1).contiguous().view(torch.int8)
    return out


def widen(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows [..., row] as `dtype` [..., D]: int8 rows dequantized (fp32, then cast), any other
    dtype cast (a bf16 cache under fp32 q)."""
    if rows.dtype != torch.int8:
        return rows.to(dtype)
    d = head_dim(rows)
    scale = rows[..., d:].contiguous().view(torch.float32)  # [..., groups]
    per_elem = scale.repeat_interleave(GROUP, dim=-1)[..., :d]
    return (rows[..., :d].float() * per_elem).to(dtype)
