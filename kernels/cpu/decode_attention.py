"""Launcher for kernels/cpu/cpu_decode_attention.c: checks shapes, then one C call (GIL released).

Reference: kernels/ref.py `_decode_rows` (gather + SDPA); tests/kernels/test_kernels_cpu.py compares the two.
"""
from __future__ import annotations

import ctypes
from functools import cache

import torch

from genpool.kernels import kvq
from genpool.kernels.cpu import build as cpu_build

_DTYPES = cpu_build.DTYPE_CODES
_KV_DTYPES = cpu_build.KV_DTYPE_CODES
_ERRORS = {-1: "out of memory", -2: "block id out of range", -3: "sequence length outside its block table"}


@cache
def _kernel():
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return cpu_build.function(
        "cpu_decode_attention", "paged_decode_attention",
        [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64,
         ctypes.POINTER(i64), ctypes.POINTER(i64), ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_int],
        ctypes.c_int)


def available() -> bool:
    return _kernel() is not None


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, D] (one query token per row) over the paged caches [blocks, bs, Hkv, D] -> [B, Hq, D].
    q float32 or bfloat16; the caches q's dtype, or bfloat16 or int8 (kernels/kvq.py's rows [blocks, bs,
    Hkv, D + 4 * ceil(D / 32)]) under float32 q (kv_cache_dtype)."""
    fn = _kernel()
    if fn is None:
        raise RuntimeError("the CPU decode-attention kernel could not be built (see the log)")
    b, hq, d = q.shape
    nblocks, bs, hkv, _ = k_cache.shape
    if q.device.type != "cpu" or k_cache.device.type != "cpu":
        raise ValueError("CPU kernel: tensors must be on the CPU")
    narrow = (torch.bfloat16, torch.int8) if q.dtype == torch.float32 else (torch.bfloat16,)
    if q.dtype not in _DTYPES or k_cache.dtype not in (q.dtype, *narrow) or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"dtypes q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}: need float32/bfloat16 q "
                         "over caches of its dtype or bfloat16, or float32 q over int8 caches")
    if v_cache.shape != k_cache.shape or kvq.head_dim(k_cache) != d or hq % hkv:
        raise ValueError(f"shapes q {tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("KV caches need a contiguous last dimension")
    if block_tables.dim() != 2 or block_tables.shape[0] != b or seq_lens.shape != (b,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} / seq_lens {tuple(seq_lens.shape)} for {b} rows")
    q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    if b == 0:
        return out
    ks = (ctypes.c_int64 * 3)(*k_cache.stride()[:3])
    vs = (ctypes.c_int64 * 3)(*v_cache.stride()[:3])
    rc = fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), tables.data_ptr(),
            lens.data_ptr(), b, hq, hkv, d, bs, tables.shape[1], nblocks, ks, vs, float(scale),
            _DTYPES[q.dtype], _KV_DTYPES[k_cache.dtype], torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"CPU decode attention failed: {_ERRORS.get(rc, rc)}")
    return out
