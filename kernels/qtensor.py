"""QTensor: a quantized linear weight, the one low-precision layout of the kernel contract.

A weight W [N, K] (N outputs, K inputs, as HF and GGUF store linear weights) kept as integers q
with a scale and an optional offset per group of `group` consecutive inputs of one output:
W[n, k] = scale[n, k // group] * q[n, k] + offset[n, k // group]. 4-bit q are packed two to a byte
along K (element 2j in the low nibble of byte j, 2j + 1 in the high one). Scales and offsets are
fp32: every format engine/models/quant.py loads converts to them exactly. Backends take a QTensor
as a linear weight (pack_linear) and lay it out for their GEMM; `dequantize` is the reference.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class QTensor:
    q: torch.Tensor            # int8 [N, K] (bits 8) or uint8 [N, K // 2] (bits 4)
    scale: torch.Tensor        # fp32 [N, K // group]
    offset: torch.Tensor | None  # fp32 [N, K // group], or None (no offset)
    bits: int
    group: int
    shape: tuple[int, int]     # (N, K)
    fmt: str = ""              # where it came from: "int8", "Q4_1", "awq", ... (reports only)

    def __post_init__(self):
        n, k = self.shape
        if self.bits not in (4, 8) or k % self.group or (self.bits == 4 and self.group % 2):
            raise ValueError(f"bad QTensor: bits {self.bits}, group {self.group}, shape {self.shape}")
        want_q = (n, k) if self.bits == 8 else (n, k // 2)
        if tuple(self.q.shape) != want_q or self.q.dtype != (torch.int8 if self.bits == 8 else torch.uint8):
            raise ValueError(f"QTensor q {tuple(self.q.shape)} {self.q.dtype}: want {want_q}")
        groups = (n, k // self.group)
        for t in (self.scale, self.offset):
            if t is not None and (tuple(t.shape) != groups or t.dtype != torch.float32):
                raise ValueError(f"QTensor scale/offset {tuple(t.shape)} {t.dtype}: want fp32 {groups}")

    def to(self, device) -> "QTensor":
        off = None if self.offset is None else self.offset.to(device)
        return QTensor(self.q.to(device), self.scale.to(device), off, self.bits, self.group, self.shape, self.fmt)

    def ints(self) -> torch.Tensor:
        """q as int32 [N, K] (4-bit: unpacked, 0..15)."""
        if self.bits == 8:
            return self.q.to(torch.int32)
        lo, hi = (self.q & 0xF).to(torch.int32), (self.q >> 4).to(torch.int32)
        return torch.stack((lo, hi), dim=-1).reshape(self.shape)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """W [N, K] fp32 (or its `rows`): scale * q (+ offset), two roundings (exact where the format's are)."""
        t = self if rows is None else _select(self, rows)
        q = t.ints()
        w = q.float().view(q.shape[0], -1, self.group) * t.scale.unsqueeze(-1)
        if t.offset is not None:
            w = w + t.offset.unsqueeze(-1)
        return w.reshape(q.shape[0], self.shape[1])


def _select(t: QTensor, rows: torch.Tensor) -> QTensor:
    off = None if t.offset is None else t.offset.index_select(0, rows)
    return QTensor(t.q.index_select(0, rows), t.scale.index_select(0, rows), off, t.bits, t.group,
                   (rows.numel(), t.shape[1]), t.fmt)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """int [N, K] in 0..15 -> uint8 [N, K // 2] (element 2j low nibble, 2j + 1 high)."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def cat(parts: list[QTensor]) -> QTensor:
    """Outputs side by side (the model's fused q|k|v and gate|up): [sum N_i, K]."""
    first = parts[0]
    same = all(p.bits == first.bits and p.group == first.group and p.shape[1] == first.shape[1]
               and (p.offset is None) == (first.offset is None) for p in parts)
    if not same:
        raise ValueError("cannot fuse quantized weights of different formats: "
                         + ", ".join(f"{p.fmt}/{p.bits}b/g{p.group}/{p.shape}" for p in parts))
    off = None if first.offset is None else torch.cat([p.offset for p in parts])
    return QTensor(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), off, first.bits,
                   first.group, (sum(p.shape[0] for p in parts), first.shape[1]), first.fmt)


def permute_rows(t: QTensor, idx: torch.Tensor) -> QTensor:
    out = _select(t, idx)
    out.shape = t.shape
    return out
