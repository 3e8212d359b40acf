"""Attention, KV-write, RMSNorm and rotary kernels: a torch reference and Triton versions.

`get_backend(name)` picks the implementation: "torch" (reference, CPU default), "triton"
(CUDA default) or "auto". The env var GENPOOL_KERNEL_BACKEND overrides "auto".
"""
from __future__ import annotations

import os
from types import SimpleNamespace

KERNEL_NAMES = ("write_kv", "paged_attention", "rms_norm", "rotary")


def _torch_backend() -> SimpleNamespace:
    from kernels import ref
    return SimpleNamespace(name="torch", **{n: getattr(ref, n) for n in KERNEL_NAMES})


def _triton_backend() -> SimpleNamespace:
    from kernels.triton_backend import build_backend
    return build_backend()


def get_backend(name: str = "auto", device: str = "cpu") -> SimpleNamespace:
    """Return an object exposing the four kernels of docs/design.md's kernel contract."""
    if name == "auto":
        name = os.environ.get("GENPOOL_KERNEL_BACKEND") or ("triton" if device.startswith("cuda") else "torch")
    if name == "torch":
        return _torch_backend()
    if name == "triton":
        return _triton_backend()
    raise ValueError(f"unknown kernel backend {name!r}; expected 'torch', 'triton' or 'auto'")
