"""Memory for the packed weights on 2 MB pages (transparent huge pages, where Linux offers them).

Why: a decode step streams every weight from DRAM (538 MB for SmolLM2 in fp32): on 4 KB pages
that is ~130K TLB misses per step, and the hardware prefetchers restart at every page. Side by
side on a Zen 4 (30 layers' GEMMs + lm_head, weights cold, best of 7): 4 rows 17.8 vs 18.6 ms,
20 rows 32.8 vs 33.8, 48 rows 73.7 vs 77.6. With THP set to "madvise" (the common default) plain
allocations get 4 KB pages, so the memory is mapped here and advised MADV_HUGEPAGE before it is
first touched. Weights are packed into shared 64 MB arenas (each an aligned run of huge pages)
rather than one mapping each, which would round every small weight up to whole 2 MB pages; an
arena is unmapped once no tensor in it is alive and it is no longer the one being filled. Elsewhere (no MADV_HUGEPAGE), or with
GENPOOL_HUGE_PAGES=0: torch.empty.
"""
from __future__ import annotations

import math
import mmap
import threading

import torch

from genpool.kernels.settings import kernel_settings

HUGE_PAGE = 2 << 20
ARENA_BYTES = 64 << 20
ALIGN = 64  # a cache line: the GEMM's panel rows start on one
_lock = threading.Lock()
_arena: dict = {"buf": None, "used": 0, "size": 0}


def huge_pages_available() -> bool:
    """Whether weight_empty maps huge-page memory: Linux's MADV_HUGEPAGE, not turned off."""
    return (hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_ANONYMOUS")
            and kernel_settings().huge_pages)  # EngineConfig.huge_pages (GENPOOL_HUGE_PAGES)


def _map(nbytes: int) -> torch.Tensor:
    """A fresh anonymous mapping advised for huge pages, as a uint8 tensor starting on a 2 MB
    boundary, nbytes long (the tensor keeps the mapping alive)."""
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE)  # before any page is touched: they fault in as 2 MB pages
    raw = torch.frombuffer(mm, dtype=torch.uint8)
    off = -raw.data_ptr() % HUGE_PAGE
    return raw[off:off + nbytes]


def weight_empty(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised contiguous tensor for a weight that lives as long as its model."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not huge_pages_available() or nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    if nbytes > ARENA_BYTES // 4:  # big (an lm_head): its own run of pages
        size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
        return _map(size)[:nbytes].view(dtype).view(shape)
    with _lock:
        start = -(-_arena["used"] // ALIGN) * ALIGN
        if _arena["buf"] is None or start + nbytes > _arena["size"]:
            _arena.update(buf=_map(ARENA_BYTES), size=ARENA_BYTES)
            start = 0
        _arena["used"] = start + nbytes
        piece = _arena["buf"][start:start + nbytes]
    return piece.view(dtype).view(shape)
