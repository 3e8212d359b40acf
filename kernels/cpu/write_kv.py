"""Launcher for kernels/cpu/cpu_write_kv.c (scatter K/V rows into the paged caches); reference:
ref.write_kv, which this falls back to for what the C kernel does not take (casts other than
fp32 rows into a bf16 or int8 cache, non-contiguous caches or rows). An int8 cache's rows are
kernels/kvq.py's, bit for bit."""
from __future__ import annotations

import ctypes
from functools import cache

import torch

from genpool.kernels import kvq, ref
from genpool.kernels.cpu import build as cpu_build


@cache
def _kernel():
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return cpu_build.function("cpu_write_kv", "write_kv", [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_int, i64],
                              ctypes.c_int)


def available() -> bool:
    return _kernel() is not None


def _rows_ok(x: torch.Tensor, cache: torch.Tensor) -> bool:
    # [T, Hkv, D] with each token's heads contiguous; the cache's dtype, or fp32 into a bf16 / int8 cache
    return (x.dim() == 3 and x.shape[1] == cache.shape[2] and x.shape[2] == kvq.head_dim(cache)
            and _cast_ok(x, cache) and x.stride(2) == 1 and x.stride(1) == x.shape[2])


def _cast_ok(x: torch.Tensor, cache: torch.Tensor) -> bool:
    """A plain copy, or fp32 rows rounded into a bf16 cache or quantized into an int8 one: what the
    C kernel does."""
    if x.dtype == torch.float32 and cache.dtype in _MODES:
        return True
    return x.dtype == cache.dtype and cache.dtype != torch.int8


_MODES = {torch.bfloat16: 1, torch.int8: 2}  # the kernel's mode for fp32 rows into a narrower cache


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """As ref.write_kv: k/v [T, Hkv, D] into the caches at flat slots; slot -1 is skipped."""
    fn = _kernel()
    simple = (fn is not None and k_cache.is_contiguous() and v_cache.is_contiguous()
              and v_cache.shape == k_cache.shape and v_cache.dtype == k_cache.dtype
              and _rows_ok(k, k_cache) and _rows_ok(v, v_cache) and k.shape[0] == v.shape[0]
              and k.device.type == "cpu" and k_cache.device.type == "cpu")
    if not simple:
        return ref.write_kv(k, v, k_cache, v_cache, slot_mapping)
    slots = slot_mapping.to(torch.int64).contiguous()
    if slots.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} for {k.shape[0]} rows")
    nslots = k_cache.shape[0] * k_cache.shape[1]
    rc = fn(k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), k.shape[0],
            k.shape[1] * k.shape[2], k.stride(0), v.stride(0), nslots, k_cache.element_size(),
            _MODES.get(k_cache.dtype, 0) if k.dtype != k_cache.dtype else 0, k.shape[2])
    if rc != 0:
        raise ValueError(f"a slot lies outside the KV cache of {nslots} slots")
    return None
