"""KV memory with prefix caching: 50 requests sharing a ~500-token prefix, caching on vs off.

vLLM's motivating example (a shared system prompt) saves most KV memory; target here: with
prefix caching the requests hold <= 45% of the blocks they hold without it. Prints one table.

  python benchmarks/prefix_memory.py [--model smollm2-135m] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, last: benchmarks.* and tests.* only, installed packages first

from genpool.engine import LLM, SamplingParams  # noqa: E402

PREFIX = ("You are reviewing customer feedback for a bicycle shop. For each message, classify "
          "the sentiment, name the product involved, and suggest one concrete follow-up action "
          "for the support team. Be brief and factual. ") * 12


def run(model: str, dtype: str, caching: bool, n: int, max_tokens: int) -> dict:
    llm = LLM(model, dtype=dtype, enable_prefix_caching=caching, max_num_seqs=64,
              max_num_batched_tokens=2048, num_kv_blocks=4096)
    tok, eng = llm.get_tokenizer(), llm.llm_engine
    prefix = tok(PREFIX, add_special_tokens=False)["input_ids"][:500]
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(n):
        suffix = tok(f" Message {i}: the gears on my new bike slip when climbing.",
                     add_special_tokens=False)["input_ids"]
        eng.add_request(f"r{i}", {"prompt_token_ids": prefix + suffix}, sp)
    peak, t0 = 0, time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
        peak = max(peak, eng.stats()["kv_blocks_used"])
    st = eng.stats()
    return dict(peak=peak, seconds=time.perf_counter() - t0, hits=st["prefix_cache_hits"],
                queries=st["prefix_cache_queries"], bytes_per_block=llm.llm_engine.runner.bytes_per_block)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-requests", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args(argv)
    on = run(args.model, args.dtype, True, args.num_requests, args.max_tokens)
    off = run(args.model, args.dtype, False, args.num_requests, args.max_tokens)
    print(f"{'prefix caching':>15} {'peak KV blocks':>15} {'peak KV MiB':>12} {'hit rate':>9} {'seconds':>8}")
    for name, r in (("on", on), ("off", off)):
        rate = r["hits"] / r["queries"] if r["queries"] else 0.0
        mib = r["peak"] * r["bytes_per_block"] / 2**20
        print(f"{name:>15} {r['peak']:>15} {mib:>12.1f} {rate:>9.1%} {r['seconds']:>8.1f}")
    ratio = on["peak"] / off["peak"]
    print(f"ratio on/off: {ratio:.1%} (target <= 45%): {'PASS' if ratio <= 0.45 else 'FAIL'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
