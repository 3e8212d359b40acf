"""Launcher for kernels/cpu/cpu_silu_mul.c (SwiGLU over a fused gate_up row); reference: ref.silu_and_mul."""
from __future__ import annotations

import ctypes
from functools import cache

import torch

from genpool.kernels.cpu import build as cpu_build

_DTYPES = cpu_build.DTYPE_CODES


@cache
def _kernel():
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return cpu_build.function("cpu_silu_mul", "silu_mul", [ptr, ptr, i64, i64, i64, ctypes.c_int, ctypes.c_int])


def available() -> bool:
    return _kernel() is not None


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up, [T, I]."""
    fn = _kernel()
    if fn is None:
        raise RuntimeError("the CPU silu_mul kernel could not be built (see the log)")
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(-1) != 1 or x.dtype not in _DTYPES or x.device.type != "cpu":
        raise ValueError(f"x must be a CPU [T, 2I] float32/bfloat16 tensor with contiguous rows, got "
                         f"{tuple(x.shape)} {x.dtype} strides {x.stride()}")
    t, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(t, inter, dtype=x.dtype)
    fn(x.data_ptr(), out.data_ptr(), t, inter, x.stride(0), _DTYPES[x.dtype], torch.get_num_threads())
    return out
