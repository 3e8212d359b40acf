"""The CPU kernel backend: the torch reference with its hot spots replaced by C kernels.

- paged attention: decode rows go to kernels/cpu/cpu_decode_attention.c, which reads K/V in place
  from the paged cache instead of gathering padded copies; fp32 prefill chunks go to
  kernels/cpu/cpu_prefill_attention.c (K/V packed once per sequence and kv head, both products on the
  GEMM's register tiles; 1.5-2.1x torch's flash SDPA for prompts of 64-2048 tokens on a Zen 4),
  other dtypes keep the reference's SDPA;
- rotary: kernels/cpu/cpu_rotary.c, one pass instead of ~14 torch ops (bit-identical);
- silu_and_mul: kernels/cpu/cpu_silu_mul.c, one pass over the fused gate_up output instead of two
  over its strided halves; gate_up_silu: fp32 SwiGLU as the GEMM's epilogue (cpu_gemm.gemm_swiglu,
  same bits), so the [T, 2I] product never goes to memory; the two kernels apart otherwise;
- linear: kernels/cpu/cpu_gemm.c, with each weight packed once into 16- or 32-column panels (MKL ran
  decode-sized products at a fraction of the CPU's speed and repacked the weight per call); bf16
  models too where the CPU has no bf16 matmul instructions, their weights widened to fp32 once
  (torch's bf16 GEMM ran at ~1 GFLOP/s there; with AMX it is far faster and is kept, see
  bf16_matmul_hardware()); GENPOOL_CPU_GEMM=0 turns ours off (use_tile_kernels());
- linear over a quantized weight (kernels/qtensor.py QTensor: int8, GGUF, AWQ): kernels/cpu/cpu_qgemm.c;
- write_kv: kernels/cpu/cpu_write_kv.c, a memcpy per row instead of two index_copy_ calls;
- rms_norm: kernels/cpu/cpu_rms_norm.c for fp32 (one pass instead of 7 ops); bf16 keeps the
  reference, whose vectorised bf16 conversions beat the C kernel's scalar ones;
- decode_layers: kernels/cpu/cpu_decode_layers.c, a pure-decode step's whole fp32 stack in one call (the
  kernels above, launched from C instead of Python; same bits).
`build_backend()` returns None when the C kernels cannot be built (no compiler): "auto" then uses
"torch", an explicit "cpu" is an error.
"""
from __future__ import annotations

from functools import partial

import torch

from genpool.kernels import ref
from genpool.kernels.backend import DecodeStack, TorchBackend
from genpool.kernels.cpu import build as cpu_build
from genpool.kernels.cpu import decode_attention as cpu_decode_attention
from genpool.kernels.cpu import decode_layers as cpu_decode_layers
from genpool.kernels.cpu import gemm as cpu_gemm
from genpool.kernels.cpu import prefill_attention as cpu_prefill_attention
from genpool.kernels.cpu import qgemm as cpu_qgemm
from genpool.kernels.cpu import rms_norm as cpu_rms_norm
from genpool.kernels.cpu import rotary as cpu_rotary
from genpool.kernels.cpu import silu_mul as cpu_silu_mul
from genpool.kernels.cpu import write_kv as cpu_write_kv
from genpool.kernels.qtensor import QTensor
from genpool.kernels.settings import kernel_settings


def _rms_norm(x, weight, eps, residual=None):
    if x.dtype == torch.float32 and x.stride(-1) == 1 and (residual is None or residual.stride(-1) == 1):
        return cpu_rms_norm.rms_norm(x, weight, eps, residual)
    return ref.rms_norm(x, weight, eps, residual)


def use_tile_kernels() -> bool:
    """Whether fp32 linear layers and prefill attention take our register-tile kernels.

    Yes by default (AVX2 and AVX-512 builds alike); cpu_gemm off (GENPOOL_CPU_GEMM=0) keeps torch's MKL GEMM and
    flash SDPA (on: ours; bf16 weights on bf16 hardware stay on torch either way). On a 2-core AVX-512 Xeon, against MKL: decode-sized products
    (1-48 rows) 0.8-1.6x, prompt-sized (2048 rows) 0.85-0.88x; the engine's benchmark run was faster
    with ours (docs/kernels.md)."""
    return kernel_settings().cpu_gemm  # EngineConfig.cpu_gemm (GENPOOL_CPU_GEMM): kernels/settings.py


def bf16_matmul_hardware() -> bool:
    """Whether the CPU multiplies bf16 natively (AMX or AVX512-BF16): torch's bf16 GEMM then beats
    our fp32 one on prompt-sized products (AMX Xeon: 2.5 TFLOP/s at 2048 x 576 x 3072, 540 GFLOP/s
    at 48 rows, against ~290 / ~200 in fp32; AVX512-BF16 without AMX, Zen 4: 363 against 198 at 2048
    rows, 185 / 155 at 48, even at 20, but 0.5-0.8x ours at 1-8 rows); without it, torch's bf16 GEMM
    ran at ~1 GFLOP/s (AVX2 EPYC)."""
    return cpu_build.cpu_has("amx_bf16") or cpu_build.cpu_has("avx512_bf16")


def _pack_linear(weight_t, bias=None):
    if isinstance(weight_t, QTensor):  # quantized: kernels/cpu/cpu_qgemm.c reads it packed
        return cpu_qgemm.QPackedWeight(weight_t, bias) if cpu_qgemm.available() else ref.pack_linear(weight_t, bias)
    if not use_tile_kernels() or weight_t.dtype not in (torch.float32, torch.bfloat16):
        return ref.pack_linear(weight_t, bias)
    if weight_t.dtype == torch.bfloat16:
        if bf16_matmul_hardware():
            return ref.pack_linear(weight_t, bias)
        # widened once (exactly): fp32 FMAs, each output rounded once on the way out
        return cpu_gemm.PackedWeight(weight_t.float(), None if bias is None else bias.float())
    return cpu_gemm.PackedWeight(weight_t, bias)


def _linear(x, w):
    if isinstance(w, cpu_qgemm.QPackedWeight):  # fp32 activations; bf16 ones widened and rounded back
        return cpu_qgemm.qgemm(x, w) if x.dtype == torch.float32 else cpu_qgemm.qgemm(x.float(), w).to(x.dtype)
    if not isinstance(w, cpu_gemm.PackedWeight):
        return ref.linear(x, w)
    if x.dtype != torch.float32:  # bf16 in, fp32 FMAs, rounded once on the way out
        return cpu_gemm.gemm(x.float(), w).to(x.dtype)
    return cpu_gemm.gemm(x, w)


def _gate_up_silu(x, w):
    if isinstance(w, cpu_qgemm.QPackedWeight) and x.dtype == torch.float32 and w.swiglu_fusable:
        return cpu_qgemm.qgemm_swiglu(x, w)
    if isinstance(w, cpu_gemm.PackedWeight) and x.dtype == torch.float32 and w.swiglu_fusable:
        return cpu_gemm.gemm_swiglu(x, w)
    return cpu_silu_mul.silu_and_mul(_linear(x, w))


class CpuBackend(TorchBackend):
    """The reference with the C kernels above; decode_layers when our GEMM packs the weights (its
    packed weights are what the stack reads)."""
    name = "cpu"
    linear_keeps_weight = False
    write_kv = staticmethod(cpu_write_kv.write_kv)
    rms_norm = staticmethod(_rms_norm)
    rotary = staticmethod(cpu_rotary.rotary)
    silu_and_mul = staticmethod(cpu_silu_mul.silu_and_mul)
    gate_up_silu = staticmethod(_gate_up_silu)
    pack_linear = staticmethod(_pack_linear)
    linear = staticmethod(_linear)

    def __init__(self):
        self.tiles = use_tile_kernels()  # read once: the packed weights and the stack must agree
        prefill = cpu_prefill_attention.prefill_rows if self.tiles else ref.prefill_rows
        self.paged_attention = partial(ref.mixed_attention, decode_rows=cpu_decode_attention.decode_attention,
                                       prefill=prefill)

    def decode_layers(self, layers: list[dict], final_norm: torch.Tensor, **dims) -> DecodeStack | None:
        if not (self.tiles and cpu_decode_layers.available()):
            return None
        return cpu_decode_layers.build(layers, final_norm, **dims)


def build_backend() -> CpuBackend | None:
    """The CPU backend, or None when the C kernels cannot be built (no compiler)."""
    kernels = (cpu_decode_attention, cpu_gemm, cpu_prefill_attention, cpu_rms_norm, cpu_rotary, cpu_silu_mul,
               cpu_write_kv)
    if not all(k.available() for k in kernels):
        return None
    return CpuBackend()
