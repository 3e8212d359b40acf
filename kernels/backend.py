"""The kernel contract (docs/design.md) as types: what the model calls, and the torch reference.

`KernelBackend` is what engine/models/llama.py is written against; `TorchBackend` (kernels/ref.py)
is the reference the others extend: CpuBackend (kernels/cpu/backend.py) and TritonBackend
(kernels/triton/backend.py) replace some of its kernels and keep the rest.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch

from genpool.kernels import ref


class DecodeStack(Protocol):
    """A pure-decode step's whole decoder stack in one call, bound to one set of KV caches:
    embeddings [B, H] -> final-normed hidden [B, H], writing each layer's K/V."""

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, rope: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor: ...


class KernelBackend(Protocol):
    name: str
    linear_keeps_weight: bool  # False: pack_linear's result replaces the loaded weight (held once)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None: ...

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        scale: float) -> torch.Tensor: ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rotary(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...

    def gate_up_silu(self, x: torch.Tensor, w: Any) -> torch.Tensor: ...

    def pack_linear(self, weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> Any: ...

    def linear(self, x: torch.Tensor, w: Any) -> torch.Tensor: ...

    def decode_layers(self, layers: list[dict], final_norm: torch.Tensor, **dims) -> DecodeStack | None:
        """The one-call stack for these layers, or None where the backend has none or cannot run them."""
        ...


class TorchBackend:
    """The reference: every kernel from kernels/ref.py, no decode stack."""
    name = "torch"
    linear_keeps_weight = True
    write_kv = staticmethod(ref.write_kv)
    paged_attention = staticmethod(ref.paged_attention)
    rms_norm = staticmethod(ref.rms_norm)
    rotary = staticmethod(ref.rotary)
    silu_and_mul = staticmethod(ref.silu_and_mul)
    gate_up_silu = staticmethod(ref.gate_up_silu)
    pack_linear = staticmethod(ref.pack_linear)
    linear = staticmethod(ref.linear)

    def decode_layers(self, layers: list[dict], final_norm: torch.Tensor, **dims) -> DecodeStack | None:
        return None
