"""Keep glibc from handing big activation buffers back to the kernel after every op.

glibc serves allocations above its mmap threshold with a fresh mmap and unmaps them on free,
so each [tokens, hidden] activation of a CPU forward pass page-faults its way in again (on the
2-core VM here a 2048-token prefill step spent ~15% of its time in page faults). Raising the
threshold to its 32 MiB maximum and never trimming the heap lets freed activation buffers be
reused. Process-wide, so the engine calls it once, on CPU only; GENPOOL_MALLOC_TUNE=0 skips it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc refuses larger values on 64-bit
_done = False


def tune_malloc() -> bool:
    """Returns True when glibc accepted both settings (False elsewhere, e.g. musl or macOS)."""
    global _done
    if _done or os.environ.get("GENPOOL_MALLOC_TUNE", "1") == "0":
        return _done
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1
    ok = mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1 and ok
    _done = ok
    log.debug("mallopt mmap/trim thresholds %s", "set" if ok else "refused")
    return ok
