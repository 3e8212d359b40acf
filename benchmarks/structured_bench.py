"""Structured-output cost, side by side in one process (SmolLM2, greedy, fp32 CPU).

  A  48 extraction jobs, each constrained by its JSON schema
  B  the same 48 prompts unconstrained, each forced (ignore_eos, max_tokens) to generate exactly
     as many tokens as its constrained run did: same batch, same work, no grammar
  C  half-constrained batch: jobs 0, 2, 4, ... constrained, the others unconstrained (forced to
     their A lengths)
  D  the same batch with every job unconstrained (forced to the same lengths)
Target: A at most 10% slower than B; D's unconstrained jobs ... C at most 2% slower than D (the
unconstrained jobs' tokens come out at the step rate, so C vs D is their speed).
Runs are interleaved (A B C D, repeated) after a warm-up; the prefix cache holds every prompt
after the warm-up, so prefill is the same small cost in each. Also reported: each distinct
schema's compile time (a fresh engine, first sight) and the grammar cache's hit rate.

  python benchmarks/structured_bench.py --rounds 3 --json out.json
"""
from __future__ import annotations

import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, last: benchmarks.* and tests.* only, installed packages first

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

from benchmarks.records import make_cases, messages  # noqa: E402


def run(llm, prompts, params) -> tuple[float, int, list]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    return dt, sum(len(o.outputs[0].token_ids) for o in outs), outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/genpool/models/smollm2-135m"))
    ap.add_argument("--num-jobs", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    import jsonschema

    from genpool.engine import LLM, SamplingParams

    llm = LLM(a.model, num_kv_blocks=2048, max_num_seqs=64, num_threads=a.threads)
    eng = llm.llm_engine
    cases = make_cases(a.num_jobs, seed=7)
    prompts = [{"prompt_token_ids": eng.tokenizer(eng.apply_chat_template(messages(c)),
                                                  add_special_tokens=False)["input_ids"]}
               for c in cases]
    con = [SamplingParams(temperature=0, max_tokens=256, structured_outputs={"json": c.schema})
           for c in cases]
    # warm-up: compiles every schema (timed one by one by the cache), fills the prefix cache
    _, _, outs = run(llm, prompts, con)
    compile_times = list(eng.structured.cache.compile_times)
    warm = eng.stats()
    valid = 0
    for c, o in zip(cases, outs):
        try:
            jsonschema.validate(json.loads(o.outputs[0].text), c.schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    lens = [len(o.outputs[0].token_ids) for o in outs]
    free = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    half = [con[i] if i % 2 == 0 else free[i] for i in range(len(cases))]
    variants = {"A_constrained": con, "B_unconstrained": free, "C_half": half, "D_all_free": free}
    times: dict[str, list[float]] = {k: [] for k in variants}
    tokens: dict[str, int] = {}
    for r in range(a.rounds):
        for name, params in variants.items():
            dt, n, _ = run(llm, prompts, params)
            times[name].append(dt)
            tokens[name] = n
            print(f"round {r} {name}: {dt:.2f} s, {n} tokens, {n / dt:.1f} tok/s", flush=True)
    st = eng.stats()
    med = {k: statistics.median(v) for k, v in times.items()}
    report = {
        "num_jobs": len(cases), "valid_json_warmup": valid, "tokens": tokens,
        "median_s": med, "all_s": times,
        "A_over_B": med["A_constrained"] / med["B_unconstrained"],
        "C_over_D": med["C_half"] / med["D_all_free"],
        "per_round_A_over_B": [x / y for x, y in zip(times["A_constrained"], times["B_unconstrained"])],
        "per_round_C_over_D": [x / y for x, y in zip(times["C_half"], times["D_all_free"])],
        "distinct_schemas": len(compile_times),
        "compile_ms": {"mean": 1000 * statistics.mean(compile_times),
                       "median": 1000 * statistics.median(compile_times),
                       "max": 1000 * max(compile_times)},
        "cache": {k: st[k] for k in ("grammar_cache_hits", "grammar_cache_misses",
                                     "grammar_cache_hit_rate")},
        "warmup_cache": {k: warm[k] for k in ("grammar_cache_hits", "grammar_cache_misses",
                                              "grammar_cache_hit_rate")},
    }
    print(json.dumps(report, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
