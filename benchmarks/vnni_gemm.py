"""The int8 VNNI GEMM alone on SmolLM2's layer shapes (kernels/cpu/qgemm.py): ms per product and
G multiply-adds a second, per shape and over a layer's four products, at prompt-sized and
decode-sized row counts. Weights are random, quantized per output channel (the int8 mode).

    python benchmarks/vnni_gemm.py [ROWS ...]      (default: 512 48 1)
"""
from __future__ import annotations

import os
import sys
import time

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from genpool.engine.models.quant import quantize_int8  # noqa: E402
from genpool.kernels.cpu import qgemm  # noqa: E402

SHAPES = [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576), ("lm_head", 576, 49152)]


def best_seconds(f, macs: int, rounds: int = 5) -> float:
    for _ in range(3):
        f()
    reps = max(3, int(2e9 / macs))
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            f()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def main(argv: list[str]) -> int:
    torch.manual_seed(0)
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}")
    for m in [int(a) for a in argv] or [512, 48, 1]:
        layer_macs, layer_s = 0, 0.0
        for name, k, n in SHAPES:
            w = qgemm.QPackedWeight(quantize_int8(torch.randn(n, k) * 0.05))
            x = torch.randn(m, k)
            f = (lambda: qgemm.qgemm_swiglu(x, w)) if name == "gate_up" else (lambda: qgemm.qgemm(x, w))
            s = best_seconds(f, m * k * n)
            if name != "lm_head":
                layer_macs, layer_s = layer_macs + m * k * n, layer_s + s
            print(f"rows {m:4d} {name:8s} {s * 1e3:8.3f} ms {m * k * n / s / 1e9:7.1f} G/s ({w.layout})")
        print(f"rows {m}: a layer's four products {layer_macs / layer_s / 1e9:.1f} G multiply-adds/s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
