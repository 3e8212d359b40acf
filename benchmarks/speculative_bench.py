"""Speculative decoding (n-gram drafts, engine/speculative.py) on and off, side by side.

Two workloads, SmolLM2-135M-Instruct in one weight mode (`--mode`, benchmarks/quant_modes.py's
names: fp32 by default, e.g. int8-kvint8), greedy:
  copy-heavy: documents (benchmarks/workload.py's paragraphs) with instructions that copy from
              them (extract sentences verbatim, quote the key facts, summarize in the text's own
              words, correct nothing), at batch 1, 4 and 16;
  held-out:   the held-out-style mix (benchmarks/workload.py, 48 requests) as one batch.
Each configuration runs off, on, off, on, ... (`--repeats` each), so load from other processes
falls on both alike; outputs must be identical token for token (checked). Reported per mode:
output tokens/s, ms per output token of one sequence (wall time / the longest sequence's
tokens), engine steps, and drafted / accepted tokens.

  python benchmarks/speculative_bench.py --repeats 2 --json out.json
"""
from __future__ import annotations

import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

from benchmarks.quant_modes import MODE_ENV, MODES  # noqa: E402
from benchmarks.workload import PARAGRAPHS, build_workload  # noqa: E402
from genpool.engine import LLM, SamplingParams  # noqa: E402

COPY_TASKS = [
    "Copy the sentences of this text that contain a number or a date, word for word.\n\n{text}",
    "Quote the two most important sentences of the text below exactly as written.\n\n{text}",
    "Summarize the following text in its own words, reusing its phrases.\n\n{text}",
    "Repeat the following text, correcting nothing.\n\n{text}",
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4, "disable_by_batch_size": 16}


def copy_prompts(tok, n: int) -> list[dict]:
    out = []
    for i in range(n):
        text = PARAGRAPHS[i % len(PARAGRAPHS)]
        msgs = [{"role": "user", "content": COPY_TASKS[i % len(COPY_TASKS)].format(text=text)}]
        ids = tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                  add_special_tokens=False)["input_ids"]
        out.append({"prompt_token_ids": list(ids)})
    return out


def run(llm: LLM, prompts: list[dict], params: list[SamplingParams]) -> dict:
    eng = llm.llm_engine
    steps0, d0, a0 = eng.stats().step_count, eng.speculator.drafted, eng.speculator.accepted
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    ids = [o.outputs[0].token_ids for o in outs]
    tokens = sum(map(len, ids))
    return {"wall_s": wall, "tokens": tokens, "tok_per_s": tokens / wall,
            "ms_per_token": 1000 * wall / max(map(len, ids)), "steps": eng.stats().step_count - steps0,
            "drafted": eng.speculator.drafted - d0, "accepted": eng.speculator.accepted - a0,
            "ids": ids}


def compare(llms: dict, prompts, params, repeats: int) -> dict:
    runs: dict[str, list[dict]] = {m: [] for m in llms}
    for _ in range(repeats):
        for mode, llm in llms.items():
            runs[mode].append(run(llm, prompts, params))
    if runs["on"][0]["ids"] != runs["off"][0]["ids"]:
        raise SystemExit("speculative decoding changed a greedy output")
    out = {}
    for mode, rs in runs.items():
        best = {k: statistics.median(r[k] for r in rs) for k in ("tok_per_s", "ms_per_token")}
        out[mode] = {**best, "steps": rs[0]["steps"], "tokens": rs[0]["tokens"],
                     "drafted": rs[0]["drafted"], "accepted": rs[0]["accepted"]}
    out["speedup"] = out["on"]["tok_per_s"] / out["off"]["tok_per_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--mode", default="fp32", choices=sorted(MODES), help="weights and KV cache (quant_modes.py)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--mix", type=int, default=48, help="held-out mix requests (0: skip)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=NGRAM["disable_by_batch_size"],
                    help="running sequences above which nobody drafts (16 forces drafts on this table's batches; "
                         "the engine's default is 4)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ngram = dict(NGRAM, disable_by_batch_size=args.max_batch)
    os.environ.update(MODE_ENV.get(args.mode, {}))  # read once, at the first quantized product
    common = dict(MODES[args.mode], num_threads=args.threads, enable_prefix_caching=False)
    llms = {"off": LLM(args.model, **common), "on": LLM(args.model, speculative_config=ngram, **common)}
    tok = llms["off"].get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    report = {"config": ngram, "mode": args.mode, "copy": {}}
    for llm in llms.values():  # warm-up: kernels built
        llm.generate(copy_prompts(tok, 1), greedy.clone(max_tokens=4))
    print("| workload | batch | off tok/s | on tok/s | speedup | off ms/tok | on ms/tok | accepted/drafted |")
    print("|---|---|---|---|---|---|---|---|")
    rows = [("copy-heavy", int(b), copy_prompts(tok, int(b)), [greedy] * int(b))
            for b in args.batches.split(",")]
    if args.mix:
        mix = build_workload(tok, args.mix)
        rows.append(("held-out mix", len(mix), [{"prompt_token_ids": r.prompt_token_ids} for r in mix],
                     [SamplingParams(temperature=0, max_tokens=r.max_tokens) for r in mix]))
    for name, batch, prompts, params in rows:
        res = compare(llms, prompts, params, args.repeats)
        if name == "copy-heavy":
            report["copy"][str(batch)] = res
        else:
            report["mix"] = res
        off, on = res["off"], res["on"]
        print(f"| {name} | {batch} | {off['tok_per_s']:.1f} | {on['tok_per_s']:.1f} | {res['speedup']:.2f}x "
              f"| {off['ms_per_token']:.1f} | {on['ms_per_token']:.1f} | {on['accepted']}/{on['drafted']} |")
    print("outputs identical (greedy) in every configuration")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    for llm in llms.values():
        llm.close()


if __name__ == "__main__":
    main()
