"""Cost of the counter-based sampler (engine/randomness.py) against the stateful one it replaced.

Two measurements, each mode run alternately (new, old, new, old, ...) so that load from other
processes falls on both alike:
  (a) the sampler alone: one call on [rows, 49152] logits (SmolLM2's vocabulary), temperature 0.8,
      top-p 0.9, every row seeded;
  (b) the engine on the real model (SmolLM2-135M-Instruct fp32): the benchmarks/workload.py mix with
      sampled requests (temperature 0.8, top-p 0.9, seed i), output tokens per second.
"old" is the previous draw, restored for the run: torch.multinomial with one stateful
torch.Generator per (seed, completion), seeded at first use.

  python benchmarks/sampler_counter.py --num-requests 16 --max-tokens 64 --repeats 2 --json out.json
"""
from __future__ import annotations

import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from contextlib import contextmanager  # noqa: E402

import torch  # noqa: E402

from benchmarks.workload import build_workload  # noqa: E402
from genpool.engine import sampler as sampler_mod  # noqa: E402


@contextmanager
def legacy_draws():
    """Swap in the stateful draw: multinomial with a generator per (seed, completion index)."""
    gens: dict[tuple[int, int], torch.Generator] = {}

    def key_of(self, row):
        k = (row.seed, row.index)
        if k not in gens:
            gens[k] = torch.Generator().manual_seed(row.seed + 7919 * row.index)
        return gens[k]

    def draw(probs, gen):
        return int(torch.multinomial(probs, 1, generator=gen))

    saved = sampler_mod.Sampler.uniform, sampler_mod.sample_inverse_cdf
    sampler_mod.Sampler.uniform, sampler_mod.sample_inverse_cdf = key_of, draw
    try:
        yield
    finally:
        sampler_mod.Sampler.uniform, sampler_mod.sample_inverse_cdf = saved


def sampler_alone(rows: int, calls: int) -> float:
    """Seconds per sampler call on [rows, 49152] logits."""
    from genpool.engine.sampling_params import SamplingParams

    logits = torch.randn(rows, 49152, generator=torch.Generator().manual_seed(0)) * 4
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1)
    s = sampler_mod.Sampler()
    batch = [sampler_mod.SampleRow(params, [1, 2], [3] * 10, seed=i) for i in range(rows)]
    s(logits, batch)
    t0 = time.perf_counter()
    for _ in range(calls):
        s(logits, batch)
    return (time.perf_counter() - t0) / calls


def engine_run(llm, reqs, max_tokens: int) -> tuple[float, int]:
    from genpool.engine import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=min(r.max_tokens, max_tokens))
              for i, r in enumerate(reqs)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    return dt, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from genpool.engine import LLM

    result: dict = {"load_avg_start": os.getloadavg(), "sampler_call_s": {"new": [], "old": []},
                    "engine_tok_s": {"new": [], "old": []}}
    llm = LLM("smollm2-135m", dtype="float32")
    reqs = build_workload(llm.get_tokenizer(), num_requests=args.num_requests)
    engine_run(llm, reqs[:2], 8)  # warm-up
    for _ in range(args.repeats):
        for mode in ("new", "old"):
            with (legacy_draws() if mode == "old" else _noop()):
                result["sampler_call_s"][mode].append(sampler_alone(args.rows, 20))
                dt, toks = engine_run(llm, reqs, args.max_tokens)
            result["engine_tok_s"][mode].append(toks / dt)
            print(f"{mode}: sampler {result['sampler_call_s'][mode][-1] * 1e3:.2f} ms/call "
                  f"({args.rows} rows), engine {toks} tokens in {dt:.1f} s = {toks / dt:.1f} tok/s",
                  flush=True)
    best = {m: max(v) for m, v in result["engine_tok_s"].items()}
    result["engine_new_over_old"] = best["new"] / best["old"]
    result["load_avg_end"] = os.getloadavg()
    print(f"best engine tok/s: new {best['new']:.1f}, old {best['old']:.1f}, "
          f"ratio {result['engine_new_over_old']:.3f}; load {result['load_avg_end']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


@contextmanager
def _noop():
    yield


if __name__ == "__main__":
    main()
