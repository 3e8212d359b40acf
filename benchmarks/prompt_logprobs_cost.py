"""Cost of prompt log-likelihoods (SamplingParams.prompt_logprobs; the gateway's echo) against a
plain prefill of the same prompts, on the real model (SmolLM2-135M-Instruct fp32).

Three modes over the same prompts (benchmarks/workload.py's held-out-style mix), each a batch run
to the end through LLM.generate, run alternately (plain, scored, top5, plain, ...) so that load
from other processes falls on all alike:
  plain   max_tokens=1: the prefill and one sampled token (what any job pays for its prompt)
  scored  max_tokens=0, prompt_logprobs=0: every prompt token's logprob (lm-eval's loglikelihood)
  top5    max_tokens=0, prompt_logprobs=5: and the 5 most likely alternatives at each position
Prefix caching is off, so each repeat computes every prompt again. Also timed: the check every
step makes for a batch that scores nothing (LLMEngine._split's fast path), the whole cost a job
that does not ask pays.

  python benchmarks/prompt_logprobs_cost.py --num-requests 16 --repeats 3 --json out.json
"""
from __future__ import annotations

import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

from benchmarks.workload import build_workload  # noqa: E402
from genpool.engine import LLM, SamplingParams  # noqa: E402
from genpool.engine.llm_engine import LLMEngine  # noqa: E402
from genpool.engine.sequence import Sequence  # noqa: E402

MODES = {
    "plain": SamplingParams(temperature=0, max_tokens=1),
    "scored": SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=0),
    "top5": SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=5),
}


def run(llm: LLM, prompts: list[dict], params: SamplingParams) -> float:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    if params.prompt_logprobs is not None:  # every prompt token after the first was scored
        assert all(len(o.prompt_logprobs) == len(o.prompt_token_ids) for o in outs)
    return dt


def fast_path_us(batch: int = 64) -> float:
    """Microseconds per step for the check a step that scores nothing makes."""
    seqs = [(Sequence(str(i), list(range(200)), MODES["plain"]), 1) for i in range(batch)]
    n, t0 = 2000, time.perf_counter()
    for _ in range(n):
        LLMEngine._split(seqs, None)
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the figures here too")
    args = ap.parse_args()
    llm = LLM(args.model, dtype="float32", num_threads=args.threads, enable_prefix_caching=False,
              max_num_batched_tokens=1024)
    reqs = build_workload(llm.get_tokenizer(), args.num_requests)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    tokens = sum(len(r.prompt_token_ids) for r in reqs)
    run(llm, prompts[:2], MODES["plain"])  # warm-up: kernels built, caches touched
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(args.repeats):
        for mode, params in MODES.items():
            times[mode].append(run(llm, prompts, params))
    med = {m: statistics.median(v) for m, v in times.items()}
    report = {"prompts": len(reqs), "prompt_tokens": tokens, "repeats": args.repeats,
              "median_s": med, "prompt_tok_per_s": {m: tokens / s for m, s in med.items()},
              "cost_vs_plain": {m: med[m] / med["plain"] - 1 for m in MODES},
              "no_scoring_check_us_per_step_64_seqs": fast_path_us()}
    print("| mode | median s | prompt tok/s | vs plain |\n|---|---|---|---|")
    for m in MODES:
        print(f"| {m} | {med[m]:.2f} | {tokens / med[m]:.0f} | {report['cost_vs_plain'][m]:+.1%} |")
    print(f"{len(reqs)} prompts, {tokens} prompt tokens, {args.repeats} repeats each; the check a "
          f"step that scores nothing makes: {report['no_scoring_check_us_per_step_64_seqs']:.1f} "
          f"us per step of 64 sequences")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    llm.close()


if __name__ == "__main__":
    main()
