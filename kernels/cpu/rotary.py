"""Launcher for kernels/cpu/cpu_rotary.c (rotate_half rotary on q and k, one pass); reference: ref.rotary."""
from __future__ import annotations

import ctypes
from functools import cache

import torch

from genpool.kernels.cpu import build as cpu_build

_DTYPES = cpu_build.DTYPE_CODES


@cache
def _kernel():
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return cpu_build.function("cpu_rotary", "rotary", [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64,
                                                        i64, ctypes.c_int, ctypes.c_int], ctypes.c_int)


def available() -> bool:
    return _kernel() is not None


def _check_heads(name: str, x: torch.Tensor, t: int, d: int, dtype) -> None:
    if x.dim() != 3 or x.shape[0] != t or x.shape[2] != d or x.dtype != dtype or x.device.type != "cpu":
        raise ValueError(f"{name} {tuple(x.shape)} {x.dtype}: expected CPU [{t}, heads, {d}] {dtype}")
    if x.stride(2) != 1 or x.stride(1) != d:
        raise ValueError(f"{name} strides {x.stride()}: heads and head_dim must be contiguous within a token")


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
           cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D] (rows may be strided views of a fused qkv), positions [T],
    cos_sin [max_pos, D] fp32 -> new contiguous (q, k) rotated."""
    fn = _kernel()
    if fn is None:
        raise RuntimeError("the CPU rotary kernel could not be built (see the log)")
    t, hq, d = q.shape
    if q.dtype not in _DTYPES or d % 2:
        raise ValueError(f"q {q.dtype} head_dim {d}: need float32/bfloat16 and an even head_dim")
    _check_heads("q", q, t, d, q.dtype)
    _check_heads("k", k, t, d, q.dtype)
    if cos_sin.dtype != torch.float32 or cos_sin.dim() != 2 or cos_sin.shape[1] != d or not cos_sin.is_contiguous():
        raise ValueError(f"cos_sin {tuple(cos_sin.shape)} {cos_sin.dtype}: expected contiguous fp32 [max_pos, {d}]")
    pos = positions.to(torch.int64).contiguous()
    if pos.shape != (t,):
        raise ValueError(f"positions {tuple(positions.shape)} for {t} tokens")
    qo, ko = torch.empty(q.shape, dtype=q.dtype), torch.empty(k.shape, dtype=k.dtype)
    rc = fn(q.data_ptr(), k.data_ptr(), qo.data_ptr(), ko.data_ptr(), pos.data_ptr(), cos_sin.data_ptr(), t, hq,
            k.shape[1], d, q.stride(0), k.stride(0), cos_sin.shape[0], _DTYPES[q.dtype], torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"a position lies outside the rotary table of {cos_sin.shape[0]} positions")
    return qo, ko
