"""The quantized GEMMs alone on SmolLM2's layer shapes (kernels/cpu/qgemm.py) beside the fp32 GEMM:
G multiply-adds a second over a layer's four products (qkv, o, gate_up with SwiGLU, down), at
prompt-sized and decode-sized row counts, for random weights quantized as the int8 mode (per output
channel) and as int4 in groups of 32 with offsets (GGUF Q4_1's form), each packed in the layout
the compute mode picks (printed). --per-shape adds each product and the lm_head.

    python benchmarks/vnni_gemm.py [--threads N] [--per-shape] [ROWS ...]      (default: 512 48 1)
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from genpool.engine.models.quant import quantize_int8  # noqa: E402
from genpool.kernels.cpu import gemm, qgemm  # noqa: E402
from genpool.kernels.qtensor import QTensor, pack_nibbles  # noqa: E402

SHAPES = [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576)]
LM_HEAD = ("lm_head", 576, 49152)


def best_seconds(f, macs: int, rounds: int = 5) -> float:
    for _ in range(3):
        f()
    reps = max(3, int(1e9 / macs))
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            f()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def int4_q4_1(n: int, k: int) -> QTensor:
    """Random int4 weights in groups of 32 with an fp32 scale and offset each, as GGUF Q4_1."""
    ints = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scale, offset = torch.rand(n, k // 32) * 0.01, -torch.rand(n, k // 32) * 0.08
    return QTensor(pack_nibbles(ints), scale, offset, 4, 32, (n, k), "Q4_1")


def product(kind: str, n: int, k: int, name: str, x: torch.Tensor):
    """(the call, its layout) for one weight of this kind."""
    w = torch.randn(n, k) * 0.05
    if kind == "fp32":
        pw = gemm.PackedWeight(w.t().contiguous())
        return ((lambda: gemm.gemm_swiglu(x, pw)) if name == "gate_up" else (lambda: gemm.gemm(x, pw))), "fp32 GEMM"
    pw = qgemm.QPackedWeight(quantize_int8(w) if kind == "int8" else int4_q4_1(n, k))
    return ((lambda: qgemm.qgemm_swiglu(x, pw)) if name == "gate_up" else (lambda: qgemm.qgemm(x, pw))), pw.layout


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("rows", nargs="*", type=int)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--per-shape", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"threads {torch.get_num_threads()}, compute mode {qgemm.compute_mode()}, "
          f"load average {os.getloadavg()[0]:.1f}")
    for m in args.rows or [512, 48, 1]:
        cells = []
        for kind in ("fp32", "int8", "int4"):
            macs, seconds = 0, 0.0
            for name, k, n in SHAPES + ([LM_HEAD] if args.per_shape else []):
                x = torch.randn(m, k)
                f, layout = product(kind, n, k, name, x)
                s = best_seconds(f, m * k * n)
                if args.per_shape:
                    rate = m * k * n / s / 1e9
                    print(f"rows {m:4d} {kind:5s} {name:8s} {s * 1e3:8.3f} ms {rate:7.1f} G/s ({layout})")
                if name != "lm_head":
                    macs, seconds = macs + m * k * n, seconds + s
            cells.append(f"{kind} ({layout}) {macs / seconds / 1e9:.1f}")
        print(f"rows {m}: a layer's four products, G multiply-adds/s: " + ", ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
