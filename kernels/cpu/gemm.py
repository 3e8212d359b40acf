"""Launcher for kernels/cpu/cpu_gemm.c: fp32 x @ W with W packed once into column panels
(16 columns wide on AVX2, 32 on AVX-512: panel_width()); `gemm_swiglu` runs the MLP's fused
gate_up product with SwiGLU as its epilogue.

Reference: `x @ weight_t (+ bias)` (kernels/ref.py `linear`), and `silu_and_mul` of it for
`gemm_swiglu`; tests/kernels/test_kernels_cpu_gemm.py compares them.
"""
from __future__ import annotations

import ctypes
from functools import cache, cached_property

import torch

from genpool.kernels.cpu import build as cpu_build
from genpool.kernels.cpu import memory as cpu_memory


@cache
def _kernel():
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return cpu_build.function("cpu_gemm", "gemm_packed",
                              [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_int], ctypes.c_int)


@cache
def _swiglu_kernel():
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return cpu_build.function("cpu_gemm", "gemm_packed_swiglu", [ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_int],
                              ctypes.c_int)


def available() -> bool:
    return _kernel() is not None


@cache
def panel_width() -> int:
    """Columns per packed panel, as the C build chose them (16 for AVX2, 32 for AVX-512)."""
    fn = cpu_build.function("cpu_gemm", "gemm_panel_width", [], ctypes.c_int)
    if fn is None:
        raise RuntimeError("the CPU GEMM kernel could not be built (see the log)")
    return fn()


class PackedWeight:
    """W [K, N] as panels [ceil(N/nr), K, nr] (zero-padded columns), plus the bias if any."""

    def __init__(self, weight_t: torch.Tensor, bias: torch.Tensor | None = None):
        if weight_t.dim() != 2 or weight_t.dtype != torch.float32 or weight_t.device.type != "cpu":
            raise ValueError(f"pack a CPU float32 [K, N] weight, got {tuple(weight_t.shape)} {weight_t.dtype}")
        k, n = weight_t.shape
        nr = panel_width()
        panels = -(-n // nr)
        padded = torch.zeros(k, panels * nr, dtype=torch.float32)
        padded[:, :n] = weight_t.detach()  # no autograd record holding on to the loaded copy
        self.panels = cpu_memory.weight_empty((panels, k, nr))  # [P, K, nr], on 2 MB pages where offered
        self.panels.copy_(padded.view(k, panels, nr).transpose(0, 1))
        self.k, self.n = k, n
        self.bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
        if self.bias is not None and self.bias.shape != (n,):
            raise ValueError(f"bias {tuple(self.bias.shape)} for {n} outputs")

    @cached_property
    def swiglu_fusable(self) -> bool:
        """Whether gemm_swiglu takes this W as [gate | up]: no bias, K > 0, and I whole panels (so
        that gate panel p pairs with up panel p + I / nr). Decided once per weight, not per call."""
        half = self.n // 2
        return (self.bias is None and self.k > 0 and self.n % 2 == 0 and half >= panel_width()
                and half % panel_width() == 0 and _swiglu_kernel() is not None)


def _check_x(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != w.k or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"x must be a CPU float32 [M, {w.k}] tensor, got {tuple(x.shape)} {x.dtype}")
    return x if x.stride(1) == 1 else x.contiguous()


def gemm_swiglu(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x [M, K] float32 @ W = [gate | up] ([K, 2I]) -> silu(x @ gate) * (x @ up), [M, I], in one
    pass: the same bits as kernels/cpu/cpu_silu_mul.c over `gemm(x, w)`, without the [M, 2I] product
    going out to memory and back. W.swiglu_fusable must hold."""
    if not w.swiglu_fusable:
        raise ValueError(f"W [{w.k}, {w.n}] (bias: {w.bias is not None}) cannot run fused: need no bias and "
                         f"[gate | up] halves of whole {panel_width()}-column panels")
    x = _check_x(x, w)
    m, inter = x.shape[0], w.n // 2
    y = torch.empty(m, inter, dtype=torch.float32)
    if m:
        rc = _swiglu_kernel()(x.data_ptr(), w.panels.data_ptr(), y.data_ptr(), m, w.k, inter, x.stride(0), inter,
                              torch.get_num_threads())
        if rc == -4:  # w.swiglu_fusable checked this; the C side refuses rather than trusts it
            raise ValueError(f"CPU GEMM: {inter} SwiGLU columns are not whole {panel_width()}-column panels")
        if rc != 0:
            raise MemoryError("CPU GEMM: out of memory for its row buffer")
    return y


def gemm(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x [M, K] float32 (rows contiguous) @ W -> [M, N] (+ bias)."""
    fn = _kernel()
    if fn is None:
        raise RuntimeError("the CPU GEMM kernel could not be built (see the log)")
    x = _check_x(x, w)
    m = x.shape[0]
    if w.k == 0:  # an empty sum (the C code slices K and would divide by zero slices)
        return torch.zeros(m, w.n) if w.bias is None else w.bias.expand(m, w.n).clone()
    y = torch.empty(m, w.n, dtype=torch.float32)
    if m:
        bias = 0 if w.bias is None else w.bias.data_ptr()
        rc = fn(x.data_ptr(), w.panels.data_ptr(), bias, y.data_ptr(), m, w.k, w.n, x.stride(0), w.n,
                torch.get_num_threads())
        if rc != 0:
            raise MemoryError("CPU GEMM: out of memory for its row buffer")
    return y
