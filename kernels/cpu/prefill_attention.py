"""Launcher for kernels/cpu/cpu_prefill_attention.c: causal attention of prefill chunks, fp32
activations over fp32 or bf16 caches.

Reference: kernels/ref.py `prefill_rows` (one SDPA per sequence over gathered K/V);
tests/kernels/test_kernels_cpu_prefill.py compares the two.
"""
from __future__ import annotations

import ctypes
from functools import cache

import torch

from genpool.kernels import kvq, ref
from genpool.kernels.cpu import build as cpu_build

_KV_DTYPES = cpu_build.KV_DTYPE_CODES  # the caches it reads: fp32, bf16 or int8 (the kernel's kv_dtype)
_ERRORS = {-1: "out of memory", -2: "block id out of range", -3: "sequence lengths outside their block table",
           -4: "unsupported shape"}


@cache
def _kernel():
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return cpu_build.function(
        "cpu_prefill_attention", "paged_prefill_attention",
        [ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64,
         ctypes.POINTER(i64), ctypes.POINTER(i64), ctypes.c_float, ctypes.c_int, ctypes.c_int], ctypes.c_int)


def available() -> bool:
    return _kernel() is not None


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """fp32 q over fp32, bf16 or int8 caches on the CPU, a head size the 16-wide tiles cover and at most 64
    query heads per kv head; anything else takes the reference."""
    hq, hkv = q.shape[1], k_cache.shape[2]
    return (q.dtype == torch.float32 and k_cache.dtype in _KV_DTYPES and q.device.type == "cpu"
            and k_cache.device.type == "cpu" and q.shape[-1] % 16 == 0 and hq % hkv == 0 and hq // hkv <= 64)


def prefill_rows(q, k_cache, v_cache, tables, q_starts, q_lens, kv_lens, scale, out) -> None:
    """Sequence i's rows q[q_starts[i] : + q_lens[i]] ([T, Hq, D]) are the last q_lens[i] of its
    kv_lens[i] positions (causal, K/V already cached); writes those rows of out."""
    if not supports(q, k_cache):
        return ref.prefill_rows(q, k_cache, v_cache, tables, q_starts, q_lens, kv_lens, scale, out)
    fn = _kernel()
    if fn is None:
        raise RuntimeError("the CPU prefill-attention kernel could not be built (see the log)")
    t, hq, d = q.shape
    nblocks, bs, hkv, _ = k_cache.shape
    if v_cache.shape != k_cache.shape or kvq.head_dim(k_cache) != d:
        raise ValueError(f"shapes q {tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}")
    if (v_cache.dtype != k_cache.dtype or out.dtype != torch.float32 or v_cache.device.type != "cpu"
            or out.device.type != "cpu" or tables.device.type != "cpu"):
        raise ValueError(f"k_cache {k_cache.dtype}, v_cache {v_cache.dtype}, out {out.dtype}: the kernel reads "
                         "caches of one dtype and writes CPU float32")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or not q.is_contiguous() or not out.is_contiguous():
        raise ValueError("q and out must be contiguous, the KV caches need a contiguous last dimension")
    n = len(q_lens)
    if out.shape != q.shape or tables.dim() != 2 or tables.shape[0] != n or len(q_starts) != n or len(kv_lens) != n:
        raise ValueError(f"{n} sequences: tables {tuple(tables.shape)}, out {tuple(out.shape)}")
    if n == 0:
        return None
    if any(a < 0 or a + b > t for a, b in zip(q_starts, q_lens)):
        raise ValueError("query rows outside q")
    tables = tables.to(torch.int32).contiguous()
    starts, qls, kvls = (torch.tensor(x, dtype=torch.int32) for x in (q_starts, q_lens, kv_lens))
    ks = (ctypes.c_int64 * 3)(*k_cache.stride()[:3])
    vs = (ctypes.c_int64 * 3)(*v_cache.stride()[:3])
    rc = fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), tables.data_ptr(),
            tables.shape[1], starts.data_ptr(), qls.data_ptr(), kvls.data_ptr(), n, hq, hkv, d, bs, nblocks,
            ks, vs, float(scale), _KV_DTYPES[k_cache.dtype], torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"CPU prefill attention failed: {_ERRORS.get(rc, rc)}")
    return None
