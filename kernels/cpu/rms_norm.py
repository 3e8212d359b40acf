"""Launcher for kernels/cpu/cpu_rms_norm.c (fused residual add + RMSNorm); reference: ref.rms_norm."""
from __future__ import annotations

import ctypes
from functools import cache

import torch

from genpool.kernels.cpu import build as cpu_build

_DTYPES = cpu_build.DTYPE_CODES


@cache
def _kernel():
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return cpu_build.function("cpu_rms_norm", "rms_norm", [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64,
                                                            i64, ctypes.c_float, ctypes.c_int, ctypes.c_int])


def available() -> bool:
    return _kernel() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (+ residual) [T, H] -> (RMSNorm(sum) * weight, sum), as ref.rms_norm."""
    fn = _kernel()
    if fn is None:
        raise RuntimeError("the CPU rms_norm kernel could not be built (see the log)")
    if x.dim() != 2 or x.stride(-1) != 1 or x.dtype not in _DTYPES or x.device.type != "cpu":
        raise ValueError(f"x must be a CPU [T, H] float32/bfloat16 tensor with contiguous rows, got "
                         f"{tuple(x.shape)} {x.dtype} strides {x.stride()}")
    t, h = x.shape
    if weight.shape != (h,) or weight.dtype != x.dtype or not weight.is_contiguous():
        raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype} for hidden size {h} ({x.dtype})")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match x {tuple(x.shape)}")
    out, total = torch.empty(t, h, dtype=x.dtype), torch.empty(t, h, dtype=x.dtype)
    res_ptr, res_stride = (residual.data_ptr(), residual.stride(0)) if residual is not None else (None, 0)
    fn(x.data_ptr(), res_ptr, weight.data_ptr(), out.data_ptr(), total.data_ptr(), t, h, x.stride(0), res_stride,
       h, h, float(eps), _DTYPES[x.dtype], torch.get_num_threads())
    return out, total
