"""Launcher for kernels/cpu/cpu_token_mask.c (grammar bitmasks onto logits rows), with the numpy
reference it must equal (used where no C compiler is found)."""
from __future__ import annotations

import ctypes
from functools import cache

import numpy as np
import torch

from genpool.kernels.cpu import build as cpu_build


@cache
def _kernel():
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return cpu_build.function("cpu_token_mask", "apply_token_bitmask",
                              [ptr, i64, ptr, i64, ptr, i64, i64, ptr])


def apply_token_bitmask_ref(logits: np.ndarray, rows: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    """The reference: numpy unpack + putmask, row by row."""
    vocab = logits.shape[1]
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    allowed = np.zeros(len(rows), dtype=bool)
    for j, r in enumerate(rows):
        keep = np.zeros(vocab, dtype=bool)
        keep[: bits.shape[1]] = bits[j].astype(bool)
        allowed[j] = keep.any()
        if allowed[j]:
            np.putmask(logits[r], ~keep, -np.inf)
    return allowed


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> np.ndarray:
    """Set logits[rows[j], t] = -inf for every token t that bitmask row j (int32 words, llguidance's
    layout) forbids, in place; returns, per row, whether it allows any token (rows allowing none
    are left as they were)."""
    if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.dim() != 2 \
            or logits.stride(1) != 1:
        raise ValueError(f"logits must be CPU float32 [rows, vocab] with contiguous rows, got "
                         f"{tuple(logits.shape)} {logits.dtype} on {logits.device}")
    if bitmask.dtype != torch.int32 or not bitmask.is_contiguous() or bitmask.shape[0] != len(rows):
        raise ValueError(f"bitmask must be contiguous int32 [{len(rows)}, words], got "
                         f"{tuple(bitmask.shape)} {bitmask.dtype}")
    if rows and not 0 <= min(rows) <= max(rows) < logits.shape[0]:
        raise ValueError(f"mask rows {rows} outside the {logits.shape[0]} logits rows")
    fn = _kernel()
    if fn is None:
        return apply_token_bitmask_ref(logits.numpy(), np.asarray(rows), bitmask.numpy())
    idx = np.ascontiguousarray(rows, dtype=np.int64)
    allowed = np.zeros(len(rows), dtype=np.uint8)
    fn(logits.data_ptr(), logits.stride(0), idx.ctypes.data, len(rows), bitmask.data_ptr(),
       bitmask.shape[1], logits.shape[1], allowed.ctypes.data)
    return allowed.astype(bool)
