"""Decode attention alone over the paged KV cache (kernels/cpu/decode_attention.py), fp32 cache
against bf16 and int8 (`kv_cache_dtype` bfloat16 / int8), on SmolLM2's heads: one decode step's
attention over every layer, each layer its own cache (so no layer finds another's K/V in a CPU
cache), the dtypes alternated in one process, best of N. Prints ms a step and the K/V bytes read a
second (an int8 cache's scales included).

    python benchmarks/decode_attention.py [--rows 48] [--tokens 450] [--layers 30] [--rounds 10]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from genpool.kernels import kvq  # noqa: E402
from genpool.kernels.cpu.decode_attention import decode_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16  # SmolLM2-135M, the engine's default block size


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=48, help="sequences decoding in the step")
    ap.add_argument("--tokens", type=int, default=450, help="context length of each")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    per_row = -(-a.tokens // BLOCK)
    blocks = a.rows * per_row
    tables = torch.arange(blocks, dtype=torch.int32).view(a.rows, per_row)
    lens = torch.full((a.rows,), a.tokens, dtype=torch.int32)
    q = torch.randn(a.rows, HEADS, HEAD_DIM)
    caches = {dt: [tuple(_cache(torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM), dt) for _ in "kv")
                   for _ in range(a.layers)] for dt in (torch.float32, torch.bfloat16, torch.int8)}

    def step(dt) -> float:
        t0 = time.perf_counter()
        for k, v in caches[dt]:
            decode_attention(q, k, v, tables, lens, HEAD_DIM ** -0.5)
        return time.perf_counter() - t0

    best = {dt: min(step(dt) for _ in range(2)) for dt in caches}  # warm: builds, first touch
    for _ in range(a.rounds):
        for dt in caches:
            best[dt] = min(best[dt], step(dt))
    print(f"{a.rows} rows x {a.tokens} tokens x {a.layers} layers, {a.threads} threads, best of {a.rounds}")
    for dt, s in best.items():
        read = a.layers * a.rows * a.tokens * KV_HEADS * kvq.row_dim(HEAD_DIM, dt) * 2 * dt.itemsize
        print(f"  {str(dt).removeprefix('torch.'):9s} cache: {s * 1e3:6.1f} ms a step, {read / s / 1e9:5.1f} GB/s of K/V")
    return 0


def _cache(x: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    return kvq.quantize(x) if dt == torch.int8 else x.to(dt)


if __name__ == "__main__":
    sys.exit(main())
