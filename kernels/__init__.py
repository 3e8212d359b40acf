"""Attention, KV-write, RMSNorm, rotary, SwiGLU and linear (GEMM) kernels: a torch reference, C kernels for the CPU
and Triton kernels for CUDA.

`get_backend(name)` picks the implementation: "torch" (the reference), "cpu" (the reference plus
C kernels; CPU default when a C compiler is present, else "torch"), "triton" (CUDA default) or
"auto". The env var GENPOOL_KERNEL_BACKEND overrides "auto".
"""
from __future__ import annotations

import os
from types import SimpleNamespace

KERNEL_NAMES = ("write_kv", "paged_attention", "rms_norm", "rotary", "silu_and_mul", "gate_up_silu", "pack_linear",
                "linear")


def _torch_backend() -> SimpleNamespace:
    from kernels import ref
    return SimpleNamespace(name="torch", linear_keeps_weight=True, **{n: getattr(ref, n) for n in KERNEL_NAMES})


def _triton_backend() -> SimpleNamespace:
    from kernels.triton_backend import build_backend
    return build_backend()


def _cpu_backend(required: bool) -> SimpleNamespace:
    from kernels.cpu_backend import build_backend
    backend = build_backend()
    if backend is None:
        if required:
            raise RuntimeError("kernel backend 'cpu' needs a C compiler (cc/gcc/clang or $CC); see the log")
        return _torch_backend()
    return backend


def get_backend(name: str = "auto", device: str = "cpu") -> SimpleNamespace:
    """Return an object exposing the kernels of docs/design.md's kernel contract."""
    auto = name == "auto"
    if auto:
        name = os.environ.get("GENPOOL_KERNEL_BACKEND") or ("triton" if device.startswith("cuda") else "cpu")
    if name == "torch":
        return _torch_backend()
    if name == "cpu":
        return _cpu_backend(required=not auto)
    if name == "triton":
        return _triton_backend()
    raise ValueError(f"unknown kernel backend {name!r}; expected 'torch', 'cpu', 'triton' or 'auto'")
