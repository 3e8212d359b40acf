"""Keep glibc from handing big activation buffers back to the kernel after every op.

glibc serves allocations above its mmap threshold with a fresh mmap and unmaps them on free,
so each [tokens, hidden] activation of a CPU forward pass page-faults its way in again (on the
2-core VM here a 2048-token prefill step spent ~15% of its time in page faults). Raising the
threshold to its 32 MiB maximum and never trimming the heap lets freed activation buffers be
reused. Process-wide, so the engine calls it once, on CPU only; EngineConfig.malloc_tune=False
(GENPOOL_MALLOC_TUNE=0) skips it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import mmap

from genpool.schemas.settings import value

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc refuses larger values on 64-bit
_done = False


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, looked up once (find_library runs `ldconfig -p`: ~3 ms a call)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"))
    except (OSError, TypeError):
        return None


def tune_malloc(enabled: bool | None = None) -> bool:
    """Returns True when glibc accepted both settings (False elsewhere, e.g. musl or macOS).
    `enabled`: the engine's config.malloc_tune; None: the settings table's (env, else on)."""
    global _done
    if _done or not value("GENPOOL_MALLOC_TUNE", enabled):
        return _done
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1
    ok = mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1 and ok
    _done = ok
    log.debug("mallopt mmap/trim thresholds %s", "set" if ok else "refused")
    return ok


def trim_heap() -> bool:
    """Give freed heap memory back to the kernel (glibc malloc_trim). tune_malloc() stops glibc
    from trimming on its own, so call this after phases that free much at once: the loaded
    weights once packed, the activations of a large prefill once the engine goes idle."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    return bool(trim(0))


def lazy_zeros(shape: tuple, dtype):
    """A zero tensor whose pages the kernel provides on first write (an anonymous mapping): a KV
    cache reserved for the worst case costs resident memory only as far as it is used.
    torch.zeros would write, and so make resident, every page at once."""
    import torch

    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, max(n, 1))  # the tensor keeps a reference to it
    return torch.frombuffer(buf, dtype=dtype, count=math.prod(shape)).view(shape)


KV_FREE_FRACTION = 0.25  # of the memory available at start
KV_CAP = 2 << 30


def mem_available() -> int:
    """MemAvailable from /proc/meminfo (0 where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def default_kv_budget(need_bytes: int) -> int:
    """KV bytes when the caller gave none: what the model can use at most (max_num_seqs full
    contexts), but no more than a quarter of the memory available now and never over 2 GiB."""
    avail = mem_available()
    machine = int(avail * KV_FREE_FRACTION) if avail else KV_CAP
    return max(1, min(need_bytes, machine, KV_CAP))
