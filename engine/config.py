"""Engine configuration: one dataclass, validated once."""
from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass
class EngineConfig:
    model: str
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None
    kv_cache_memory: int = 2 << 30  # bytes of K/V on the CPU when num_kv_blocks is not given
    gpu_memory_utilization: float = 0.85  # fraction of GPU memory for weights + KV on CUDA
    max_model_len: int | None = None
    kernel_backend: str = "auto"  # "torch" | "cpu" | "triton" | "auto"
    num_threads: int | None = None  # torch intra-op threads on the CPU
    seed: int = 0

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
