"""Attention, KV-write, RMSNorm, rotary, SwiGLU and linear (GEMM) kernels: a torch reference, C kernels for the CPU
and Triton kernels for CUDA.

`get_backend(name)` picks the implementation: "torch" (the reference), "cpu" (the reference plus
C kernels; CPU default when a C compiler is present, else "torch"), "triton" (CUDA default) or
"auto". GENPOOL_KERNEL_BACKEND lands in EngineConfig.kernel_backend (schemas/settings.py), not here.
"""
from __future__ import annotations

from genpool.kernels.backend import DecodeStack, KernelBackend, TorchBackend

__all__ = ["DecodeStack", "KernelBackend", "TorchBackend", "get_backend"]


def _triton_backend() -> KernelBackend:
    from genpool.kernels.triton.backend import TritonBackend
    return TritonBackend()


def _cpu_backend(required: bool) -> KernelBackend:
    from genpool.kernels.cpu.backend import build_backend
    backend = build_backend()
    if backend is None:
        if required:
            raise RuntimeError("kernel backend 'cpu' needs a C compiler (cc/gcc/clang or $CC); see the log")
        return TorchBackend()
    return backend


def get_backend(name: str = "auto", device: str = "cpu") -> KernelBackend:
    """The kernels of docs/design.md's contract (kernels/backend.py's KernelBackend) for `name`."""
    auto = name == "auto"
    if auto:
        name = "triton" if device.startswith("cuda") else "cpu"
    if name == "torch":
        return TorchBackend()
    if name == "cpu":
        return _cpu_backend(required=not auto)
    if name == "triton":
        return _triton_backend()
    raise ValueError(f"unknown kernel backend {name!r}; expected 'torch', 'cpu', 'triton' or 'auto'")
