"""Build-once loader for the C kernels in kernels/*.c (CPU backend).

Each source is compiled with the system C compiler into $GENPOOL_HOME/kernels (default
~/.cache/genpool/kernels), named by a hash of source, flags and CPU model + flags, so a changed source or
another CPU gets its own library. Compilation goes to a temporary file renamed into place, so
workers starting together never load a half-written library. No compiler -> None (the caller
falls back to the torch reference) and one warning in the log.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
# -march=native: the library is built on the machine that runs it (the hash includes the host).
# -fopenmp-simd: `#pragma omp simd` reductions without -ffast-math's other licences, and no OpenMP
# runtime: the threads are the kernels' own pool (cpu_pool.c, decision 0010), so a compiler without
# an OpenMP library (clang without libomp) builds the same libraries.
# -fno-strict-aliasing: the bf16 kernels widen bf16 to fp32 by writing the bits of a float buffer.
# -ffp-contract=fast: fused multiply-adds (ISO C mode turns them off; the kernels that must round
# like torch turn them off per function); -fno-math-errno: floorf etc. inline and vectorise.
# -Wl,-Bsymbolic: a library's calls into its own files (cpu_decode_layers into the GEMM, ...) bind
# to its own definitions, never to a same-named symbol another loaded library exports.
CFLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-strict-aliasing", "-ffp-contract=fast",
          "-fno-math-errno", "-fPIC", "-shared", "-std=c11", "-Wl,-Bsymbolic"]
_loaded: dict[str, ctypes.CDLL | None] = {}
# Libraries built from more than their own file: the other kernels' sources they call into
# (compiled into the same library, each file its own translation unit).
LINKED = {"cpu_decode_layers": ("cpu_gemm", "cpu_qgemm", "cpu_qgemm_vnni", "cpu_qgemm_amx", "cpu_rms_norm", "cpu_rotary",
                                 "cpu_write_kv", "cpu_decode_attention"),
          "cpu_qgemm": ("cpu_qgemm_vnni", "cpu_qgemm_amx")}
# The kernels' thread pool (cpu_pool.c): its own library, linked by every other one.
POOL = "cpu_pool"
# The `dtype` argument of every C kernel: which element type its tensors hold.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
# The `kv_dtype` argument of the kernels that read or write the KV caches: int8 is kernels/kvq.py's rows.
KV_DTYPE_CODES = {**DTYPE_CODES, torch.int8: 2}


def cache_dir() -> Path:
    from genpool.schemas.config import genpool_home  # the one definition of $GENPOOL_HOME's default
    return genpool_home() / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _cpu_identity() -> str:
    """What -march=native compiles for: the CPU model and feature flags (not the host name, which
    containers change on every start)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def cpu_has(flag: str) -> bool:
    """Whether /proc/cpuinfo lists this CPU feature flag (False where it cannot be read)."""
    return any(flag in line.split() for line in _cpu_identity().splitlines() if line.startswith("flags"))


def _sources(name: str) -> list[Path]:
    return [HERE / f"{n}.c" for n in (name, *LINKED.get(name, ()))]


def library_path(name: str, cc: str) -> Path:
    src = b"".join(p.read_bytes() for p in (*_sources(name), HERE / f"{POOL}.c"))
    src += b"".join(h.read_bytes() for h in sorted(HERE.glob("*.h")))
    key = hashlib.sha256(src + " ".join([cc, *CFLAGS, platform.machine(), _cpu_identity()]).encode())
    return cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"


def _compile(name: str, cc: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        # every kernel library links the one pool library by its absolute path (its DT_NEEDED), so
        # all of them, however loaded, share one set of pool threads
        pool = [] if name == POOL else [str(_build(POOL, cc))]
        cmd = [cc, *CFLAGS, "-I", str(HERE), "-o", tmp, *map(str, _sources(name)), *pool, "-lpthread", "-lm"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr.strip()}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build(name: str, cc: str) -> Path:
    """The library's path, built first if needed."""
    path = library_path(name, cc)
    if not path.exists():
        _compile(name, cc, path)
    return path


def function(name: str, symbol: str, argtypes: list, restype=None):
    """One C function of kernels/{name}.c with its ctypes signature, or None (no compiler)."""
    lib = load(name)
    if lib is None:
        return None
    fn = getattr(lib, symbol)
    fn.argtypes, fn.restype = argtypes, restype
    return fn


def load(name: str) -> ctypes.CDLL | None:
    """The compiled kernels/{name}.c, building it on first use; None when it cannot be built."""
    if name in _loaded:
        return _loaded[name]
    lib = None
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler found: CPU kernel %s unavailable, using the torch reference", name)
    else:
        try:
            lib = ctypes.CDLL(str(_build(name, cc)))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            log.warning("CPU kernel %s unavailable (%s); using the torch reference", name, e)
    _loaded[name] = lib
    return lib
