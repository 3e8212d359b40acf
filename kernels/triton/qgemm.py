"""Triton dequantizing GEMM for quantized linear weights (int8 per channel, GGUF Q8_0/Q4_0/Q4_1, AWQ):
y[M, N] = x[M, K] @ W^T (+ bias) with W a kernels/qtensor.py QTensor [N, K] read as stored (int8, or
two 4-bit values per byte) and widened in registers: W = scale * q + offset per group of inputs.

One program per BLOCK_M x BLOCK_N tile of y; each K step loads the tile's q bytes, its groups'
scales and offsets, widens them to the activations' dtype and runs tl.dot with fp32 accumulation.
Reference: x @ qtensor.dequantize().t() (kernels/ref.py). Tested under TRITON_INTERPRET=1 at small
sizes (tests/kernels/test_quant_triton.py); not measured on a GPU yet.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from genpool.kernels import ref
from genpool.kernels.qtensor import QTensor


@triton.jit
def _qgemm_kernel(x_ptr, q_ptr, s_ptr, o_ptr, b_ptr, y_ptr, M, N, K, G, stride_xm, stride_ym,
                  BITS: tl.constexpr, HAS_OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    groups = K // G
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K),
                    other=0.0)
        wmask = (rk[:, None] < K) & (rn[None, :] < N)
        if BITS == 8:
            q = tl.load(q_ptr + rn[None, :] * K + rk[:, None], mask=wmask, other=0).to(tl.float32)
        else:  # element 2j in the low nibble of byte j, 2j + 1 in the high one
            byte = tl.load(q_ptr + rn[None, :] * (K // 2) + rk[:, None] // 2, mask=wmask, other=0).to(tl.int32)
            q = ((byte >> ((rk[:, None] % 2) * 4)) & 15).to(tl.float32)
        gi = rn[None, :] * groups + rk[:, None] // G
        w = q * tl.load(s_ptr + gi, mask=wmask, other=0.0)
        if HAS_OFFSET:
            w = w + tl.load(o_ptr + gi, mask=wmask, other=0.0)
        acc += tl.dot(x, w.to(x.dtype))  # [BLOCK_M, BLOCK_K] @ [BLOCK_K, BLOCK_N]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def qlinear(x: torch.Tensor, w: QTensor, bias: torch.Tensor | None = None, block_m: int = 16, block_n: int = 32,
            block_k: int = 32) -> torch.Tensor:
    """x [M, K] (fp32/bf16/fp16, rows contiguous) @ W^T -> [M, N] in x's dtype."""
    n, k = w.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], got {tuple(x.shape)}")
    if block_k % 2:
        raise ValueError("block_k must be even (4-bit bytes hold two inputs)")
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return y
    off = w.offset if w.offset is not None else w.scale  # a valid pointer, unread without HAS_OFFSET
    b = bias if bias is not None else w.scale
    grid = (triton.cdiv(x.shape[0], block_m), triton.cdiv(n, block_n))
    _qgemm_kernel[grid](x, w.q, w.scale, off, b, y, x.shape[0], n, k, w.group, x.stride(0), y.stride(0),
                        BITS=w.bits, HAS_OFFSET=w.offset is not None, HAS_BIAS=bias is not None,
                        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y


class TritonQWeight:
    """A QTensor on the GPU, as the Triton backend's packed linear weight."""

    def __init__(self, w: QTensor, bias: torch.Tensor | None):
        self.w, self.bias = w, bias


def pack_linear(weight_t, bias=None):
    if isinstance(weight_t, QTensor):
        return TritonQWeight(weight_t, bias)
    return ref.pack_linear(weight_t, bias)


def linear(x: torch.Tensor, w) -> torch.Tensor:
    if isinstance(w, TritonQWeight):
        return qlinear(x, w.w, w.bias)
    return ref.linear(x, w)


def gate_up_silu(x: torch.Tensor, w) -> torch.Tensor:
    return ref.silu_and_mul(linear(x, w))
