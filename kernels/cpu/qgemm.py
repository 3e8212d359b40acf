"""Launcher for kernels/cpu/cpu_qgemm.c and cpu_qgemm_vnni.c: x @ W with W a quantized weight
(kernels/qtensor.py QTensor) packed once, in one of two layouts chosen by compute_mode():

- "vnni" (compute modes "vnni", and "amx" where asked for and the CPU has AMX tiles): integer dot products, x
  quantized to int8 per row and block of 32 inputs (cpu_qgemm_vnni.c); close to the exact product,
  not equal to it. On AVX512-VNNI and on AVX2, for int8 and int4 weights (dot_bits()), with the
  same bits on both. Under "amx", products of 32+ rows over
  int8 per-channel weights run on AMX bf16 tiles instead (cpu_qgemm_amx.c, x rounded to bf16).
- "panels": the fp32 GEMM's column panels widened in registers per slice; for GGUF and AWQ weights
  the fp32 GEMM's bits over the dequantized weight (tests/engine/test_quant.py). Prompt-sized
  products on bf16 hardware take torch's bf16 GEMM over the weight widened per call ("bf16").

GENPOOL_QUANT_COMPUTE picks: auto (default) | amx | vnni | bf16 | fp32 (every product on fp32 FMAs,
bit-exact). Reference: `x @ qtensor.dequantize().t()` (kernels/ref.py pack_linear / linear).
"""
from __future__ import annotations

import ctypes
from functools import cache

import torch

from genpool.kernels.cpu import build as cpu_build
from genpool.kernels.cpu import memory as cpu_memory
from genpool.kernels.cpu.gemm import _check_x  # the same check: x is [M, w.k] fp32 on the CPU
from genpool.kernels.qtensor import QTensor
from genpool.kernels.settings import kernel_settings


class QWeightStruct(ctypes.Structure):
    """cpu_qgemm.h's qweight_t."""
    _fields_ = [("q", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("offsets", ctypes.c_void_p),
                ("group", ctypes.c_int64), ("bits", ctypes.c_int64), ("layout", ctypes.c_int64),
                ("amx", ctypes.c_int64)]


LAYOUTS = {"panels": 0, "vnni": 1}  # cpu_qgemm.h QLAYOUT_*
VNNI_PANEL = 16  # cpu_qgemm_vnni.c VP: columns a panel (one zmm of int32 sums)


@cache
def _kernel():
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return cpu_build.function("cpu_qgemm", "qgemm_packed", [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_int],
                              ctypes.c_int)


@cache
def _swiglu_kernel():
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return cpu_build.function("cpu_qgemm", "qgemm_packed_swiglu", [ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_int],
                              ctypes.c_int)


@cache
def _widen_bf16_kernel():
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return cpu_build.function("cpu_qgemm", "qgemm_widen_bf16", [ptr, ptr, i64, i64, ctypes.c_int], ctypes.c_int)


# Rows from which a product goes to torch's bf16 GEMM (AMX / AVX512-BF16) over the weight widened
# to bf16 per call, instead of fp32 FMAs: prompt-sized batches, where the widening (K * N) is small
# against the product (M * K * N) and the bf16 units run 2.5-10x the fp32 FMA rate. Decode-sized
# batches stay on the fp32 kernel (bytes, not FLOPs, bound them).
BF16_PREFILL_ROWS = 128


COMPUTE_MODES = ("auto", "amx", "vnni", "bf16", "fp32")
DOT_MODES = ("amx", "vnni")  # the compute modes that pack the vnni layout (integer dot products)


@cache
def dot_bits() -> int:
    """Weight widths the dot-product kernel runs on this build (bit 8: int8, bit 4: int4):
    8 | 4 on AVX512-VNNI and on AVX2 (vpmaddubsw; int8 through vpsignb), 0 elsewhere."""
    fn = cpu_build.function("cpu_qgemm", "qvnni_available", [], ctypes.c_int)
    return int(fn()) if fn is not None else 0


def vnni_available() -> bool:
    """Some quantized weights run on integer dot products here (cpu_qgemm_vnni.c)."""
    return dot_bits() != 0


@cache
def amx_available() -> bool:
    """int8 weights' prompt-sized products run on AMX tiles here (cpu_qgemm_amx.c: the CPU has them
    and the OS granted their state to this process)."""
    fn = cpu_build.function("cpu_qgemm", "qamx_ready", [], ctypes.c_int)
    return bool(dot_bits() & 8) and fn is not None and bool(fn())


def amx_fits(w: QTensor) -> bool:
    """cpu_qgemm_amx.c takes it: int8, one scale per output channel, no offset, K a multiple of 32."""
    return w.bits == 8 and w.group == w.shape[1] and w.offset is None and w.shape[1] % 32 == 0


def _bf16_hardware() -> bool:
    return (cpu_build.cpu_has("amx_bf16") or cpu_build.cpu_has("avx512_bf16")) and _widen_bf16_kernel() is not None


def compute_mode() -> str:
    """How quantized products compute here (kernel_settings().quant_compute: EngineConfig.quant_compute
    or GENPOOL_QUANT_COMPUTE, default auto): "amx" only when asked for, where the CPU has AMX tiles
    and the OS grants them: "vnni", except that products of 32 rows or more over int8 per-channel
    weights run on bf16 tiles (x rounded to bf16: faster, closer to the exact product, but a row's
    result then depends on its batch); "vnni" (auto's first choice) int8 dot products where the CPU
    has them; else "bf16" (widening kernel, prompt-sized products in bf16 on bf16 hardware); else
    "fp32". A mode the CPU lacks falls back down that list."""
    return _compute_mode(kernel_settings().quant_compute)


@cache
def _compute_mode(want: str) -> str:
    if want not in COMPUTE_MODES:
        raise ValueError(f"quant_compute={want!r}: choose one of {', '.join(COMPUTE_MODES)}")
    if want == "amx" and amx_available():  # opt-in: its rows depend on their batch (docs/kernels.md)
        return "amx"
    if want in ("auto", "amx", "vnni") and vnni_available():
        return "vnni"
    if want in ("auto", "amx", "vnni", "bf16") and _bf16_hardware():
        return "bf16"
    return "fp32"


compute_mode.cache_clear = _compute_mode.cache_clear  # callers that cleared the old cache keep working


def bf16_prefill() -> bool:
    """Whether prompt-sized products over the panel layout use bf16 arithmetic."""
    return compute_mode() == "bf16"


def available() -> bool:
    return _kernel() is not None


@cache
def panel_width() -> int:
    fn = cpu_build.function("cpu_qgemm", "qgemm_panel_width", [], ctypes.c_int)
    if fn is None:
        raise RuntimeError("the CPU quantized GEMM kernel could not be built (see the log)")
    return fn()


def _panels(t: torch.Tensor, nr: int) -> torch.Tensor:
    """[N, C] -> [P, C, nr] (rows of W as panel columns; padded columns zero)."""
    n, c = t.shape
    p = -(-n // nr)
    padded = torch.zeros(p * nr, c, dtype=t.dtype)
    padded[:n] = t
    return padded.view(p, nr, c).transpose(1, 2).contiguous()


class QPackedWeight:
    """A QTensor as panels: q [P, K, NR] int8 or [P, K, NR / 2] uint8 (int4: column j low nibble,
    j + NR / 2 high), scales / offsets [P, K / group, NR] fp32 (padded columns: scale 0)."""

    def __init__(self, w: QTensor, bias: torch.Tensor | None = None, layout: str | None = None):
        self.n, self.k = w.shape
        self.bits, self.group, self.fmt = w.bits, w.group, w.fmt
        mode = compute_mode()
        self.layout = layout or ("vnni" if mode in DOT_MODES and vnni_fits(w) else "panels")
        if self.layout == "vnni" and not vnni_fits(w):
            raise ValueError(f"no VNNI layout for {w.fmt} {w.shape} group {w.group} on this build")
        nr = VNNI_PANEL if self.layout == "vnni" else panel_width()
        if self.layout == "vnni":
            q = _vnni_bytes(w)
        elif w.bits == 8:
            q = _panels(w.q, nr)
        else:
            ints = _panels(w.ints().to(torch.uint8), nr)  # [P, K, NR], 0..15
            q = ints[..., : nr // 2] | (ints[..., nr // 2:] << 4)
        self.q = cpu_memory.weight_empty(tuple(q.shape), dtype=q.dtype)
        self.q.copy_(q)
        self.scales = _panels(w.scale, nr)
        self.offsets = None if w.offset is None else _panels(w.offset, nr)
        self.bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
        if self.bias is not None and self.bias.shape != (self.n,):
            raise ValueError(f"bias {tuple(self.bias.shape)} for {self.n} outputs")
        self.struct = QWeightStruct(self.q.data_ptr(), self.scales.data_ptr(),
                                    None if self.offsets is None else self.offsets.data_ptr(), self.group, self.bits,
                                    LAYOUTS[self.layout], int(mode == "amx" and self.layout == "vnni" and amx_fits(w)))
        half = self.n // 2  # gate | up, each whole panels: the SwiGLU epilogue can take it
        self.swiglu_fusable = self.bias is None and self.n % 2 == 0 and half >= nr and half % nr == 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scales, self.offsets) if t is not None)

    def dequantize(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows of W [len(rows), K] fp32, read out of the panels: the same integers, scales and
        offsets and the same two roundings as QTensor.dequantize(rows), so the same bits. A tied
        embedding looks its rows up here (engine/models/quant.py QuantEmbedding) rather than
        keeping the QTensor the panels were packed from (the table would be held twice)."""
        rows = rows.reshape(-1).long()
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= self.n):
            raise IndexError(f"row index out of range for {self.n} rows")
        nr = self.scales.shape[-1]
        p, j = rows // nr, rows % nr
        if self.layout == "vnni":
            q = _vnni_ints(self, p, j)
        elif self.bits == 8:
            q = self.q[p, :, j].to(torch.int32)  # [T, K]
        else:  # column j < NR / 2: low nibble of byte j; else high nibble of byte j - NR / 2
            half = nr // 2
            b = self.q[p, :, j % half].to(torch.int32)
            q = torch.where((j < half).unsqueeze(1), b & 0xF, b >> 4)
        w = q.float().view(rows.numel(), self.k // self.group, self.group) * self.scales[p, :, j].unsqueeze(-1)
        if self.offsets is not None:
            w = w + self.offsets[p, :, j].unsqueeze(-1)
        return w.reshape(rows.numel(), self.k)


VNNI_BLOCK = 32  # cpu_qgemm_vnni.c AB: inputs per activation scale


def vnni_fits(w: QTensor) -> bool:
    """Weights of a width the dot products run here, in groups of whole activation blocks
    (GGUF's 32, AWQ's 128, int8's one of all K)."""
    return bool(w.bits & dot_bits()) and w.group % VNNI_BLOCK == 0 and w.shape[1] % w.group == 0


def _vnni_bytes(w: QTensor) -> torch.Tensor:
    """cpu_qgemm_vnni.c's layout: int8 [P, K/4, 16, 4] of q + 128; int4 [P, K/8, 16, 4] with k = 8j + i
    in the low nibble of byte (j, column, i) and k = 8j + 4 + i in the high one."""
    n, k = w.shape
    p = -(-n // VNNI_PANEL)
    ints = torch.zeros(p * VNNI_PANEL, k, dtype=torch.int16)
    ints[:n] = w.ints().to(torch.int16) + (128 if w.bits == 8 else 0)
    if w.bits == 8:
        return ints.view(p, VNNI_PANEL, k // 4, 4).permute(0, 2, 1, 3).to(torch.uint8).contiguous()
    quads = ints.view(p, VNNI_PANEL, k // 8, 2, 4).permute(0, 2, 1, 3, 4).to(torch.uint8)
    return (quads[:, :, :, 0] | (quads[:, :, :, 1] << 4)).contiguous()


def _vnni_ints(w: "QPackedWeight", p: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """The integers of rows (panel p, column j) of the vnni layout, [T, K] int32."""
    b = w.q[p, :, j, :].to(torch.int32)  # [T, K/4, 4] (int8) or [T, K/8, 4] (int4)
    if w.bits == 8:
        return b.reshape(len(p), w.k) - 128
    return torch.stack((b & 0xF, b >> 4), dim=2).reshape(len(p), w.k)



def _raise(rc: int) -> None:
    if rc == -1:
        raise MemoryError("CPU quantized GEMM: out of memory for its buffer")
    if rc != 0:
        raise ValueError(f"CPU quantized GEMM refused its arguments ({rc})")


def widen_bf16(w: QPackedWeight) -> torch.Tensor:
    """W as a [K, N] bf16 tensor (each weight rounded to nearest even)."""
    out = torch.empty(w.k, w.n, dtype=torch.bfloat16)
    _raise(_widen_bf16_kernel()(ctypes.byref(w.struct), out.data_ptr(), w.k, w.n, torch.get_num_threads()))
    return out


def _bf16_product(x: torch.Tensor, w: QPackedWeight) -> torch.Tensor:
    y = torch.mm(x.to(torch.bfloat16), widen_bf16(w)).float()
    return y if w.bias is None else y.add_(w.bias)


def qgemm(x: torch.Tensor, w: QPackedWeight) -> torch.Tensor:
    """x [M, K] float32 @ W -> [M, N] (+ bias). Prompt-sized batches on bf16 hardware: bf16 products
    with fp32 accumulation (bf16_prefill)."""
    fn = _kernel()
    if fn is None:
        raise RuntimeError("the CPU quantized GEMM kernel could not be built (see the log)")
    x = _check_x(x, w)
    m = x.shape[0]
    if m >= BF16_PREFILL_ROWS and w.layout == "panels" and bf16_prefill():
        return _bf16_product(x, w)
    y = torch.empty(m, w.n, dtype=torch.float32)
    if m:
        bias = 0 if w.bias is None else w.bias.data_ptr()
        _raise(fn(x.data_ptr(), ctypes.byref(w.struct), bias, y.data_ptr(), m, w.k, w.n, x.stride(0), w.n,
                  torch.get_num_threads()))
    return y


def qgemm_swiglu(x: torch.Tensor, w: QPackedWeight) -> torch.Tensor:
    """x [M, K] @ W = [gate | up] -> silu(x @ gate) * (x @ up) [M, I] in one pass (w.swiglu_fusable)."""
    if not w.swiglu_fusable:
        raise ValueError(f"W [{w.k}, {w.n}] cannot run fused: need no bias and halves of whole panels")
    x = _check_x(x, w)
    m, inter = x.shape[0], w.n // 2
    if m >= BF16_PREFILL_ROWS and w.layout == "panels" and bf16_prefill():
        from genpool.kernels.cpu.silu_mul import silu_and_mul
        return silu_and_mul(_bf16_product(x, w))
    y = torch.empty(m, inter, dtype=torch.float32)
    if m:
        _raise(_swiglu_kernel()(x.data_ptr(), ctypes.byref(w.struct), y.data_ptr(), m, w.k, inter, x.stride(0),
                                inter, torch.get_num_threads()))
    return y
