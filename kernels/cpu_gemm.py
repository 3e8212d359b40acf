"""Launcher for kernels/cpu_gemm.c: fp32 x @ W with W packed once into column panels
(16 columns wide on AVX2, 32 on AVX-512: panel_width()).

Reference: `x @ weight_t (+ bias)` (kernels/ref.py `linear`); tests/test_kernels_cpu_gemm.py compares them.
"""
from __future__ import annotations

import ctypes
from functools import cache

import torch

from kernels import cpu_build

@cache
def _kernel():
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return cpu_build.function("cpu_gemm", "gemm_packed",
                              [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_int], ctypes.c_int)


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
        self.panels = padded.view(k, panels, nr).transpose(0, 1).contiguous()  # [P, K, nr]
        self.k, self.n = k, n
        self.bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
        if self.bias is not None and self.bias.shape != (n,):
            raise ValueError(f"bias {tuple(self.bias.shape)} for {n} outputs")


def gemm(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x [M, K] float32 (rows contiguous) @ W -> [M, N] (+ bias)."""
    fn = _kernel()
    if fn is None:
        raise RuntimeError("the CPU GEMM kernel could not be built (see the log)")
    if x.dim() != 2 or x.shape[1] != w.k or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"x must be a CPU float32 [M, {w.k}] tensor, got {tuple(x.shape)} {x.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
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
