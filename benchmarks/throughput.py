"""Throughput benchmark: one fixed greedy chat workload through
  (a) HF transformers generate, one request at a time,
  (b) HF transformers static batches (left padding; each batch runs to its longest max_tokens),
  (c) genpool's engine (`from genpool.engine import LLM, SamplingParams`), all requests at once.

Counting: a request's output tokens are what it asked for and got: generated tokens up to and
including EOS, capped at its max_tokens (for (b) the tokens past that are padding work, not
counted). Timing excludes model loading and a warm-up; the same prompt_token_ids go to every system.

  python benchmarks/throughput.py --dtype float32 --num-requests 48 --json out.json
"""
from __future__ import annotations

import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, last: benchmarks.* and tests.* only, installed packages first

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from benchmarks.workload import build_workload, workload_stats  # noqa: E402
from genpool.engine.models.registry import resolve_model  # noqa: E402


def measure_copy_bandwidth(nbytes: int = 512 << 20, reps: int = 5) -> float:
    """Bytes/s moved by a large tensor copy, counting read + write (STREAM 'copy' convention)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / best


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():  # tied lm_head/embedding counted once
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def count_tokens(gen: list[int], eos_ids: set[int], max_tokens: int) -> int:
    n = 0
    for t in gen[:max_tokens]:
        n += 1
        if t in eos_ids:
            break
    return n


def load_hf(path, dtype):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).eval()
    eos = m.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    return m, eos_ids


def _gen_kwargs(max_new, pad):
    return dict(max_new_tokens=max_new, do_sample=False, temperature=None, top_p=None, top_k=None,
                pad_token_id=pad)


@torch.inference_mode()
def run_hf_single(model, eos_ids, reqs):
    pad = min(eos_ids)
    x = torch.tensor([reqs[0].prompt_token_ids[:32]])
    model.generate(x, attention_mask=torch.ones_like(x), **_gen_kwargs(4, pad))  # warm-up
    outs, t0 = [], time.perf_counter()
    for r in reqs:
        x = torch.tensor([r.prompt_token_ids])
        y = model.generate(x, attention_mask=torch.ones_like(x), **_gen_kwargs(r.max_tokens, pad))
        outs.append(y[0, x.shape[1]:].tolist())
    dt = time.perf_counter() - t0
    toks = [count_tokens(g, eos_ids, r.max_tokens) for g, r in zip(outs, reqs)]
    return dt, toks, [g[:n] for g, n in zip(outs, toks)]


@torch.inference_mode()
def run_hf_batched(model, eos_ids, reqs, batch_size):
    pad = min(eos_ids)

    def batch_inputs(group):
        L = max(r.prompt_len for r in group)
        ids = torch.full((len(group), L), pad, dtype=torch.long)
        mask = torch.zeros((len(group), L), dtype=torch.long)
        for i, r in enumerate(group):  # left padding
            ids[i, L - r.prompt_len:] = torch.tensor(r.prompt_token_ids)
            mask[i, L - r.prompt_len:] = 1
        return ids, mask

    ids, mask = batch_inputs(reqs[:2])
    model.generate(ids[:, -32:], attention_mask=mask[:, -32:], **_gen_kwargs(4, pad))  # warm-up
    outs, t0 = [], time.perf_counter()
    for s in range(0, len(reqs), batch_size):
        group = reqs[s:s + batch_size]
        ids, mask = batch_inputs(group)
        y = model.generate(ids, attention_mask=mask, **_gen_kwargs(max(r.max_tokens for r in group), pad))
        outs.extend(y[:, ids.shape[1]:].tolist())
    dt = time.perf_counter() - t0
    toks = [count_tokens(g, eos_ids, r.max_tokens) for g, r in zip(outs, reqs)]
    return dt, toks, [g[:n] for g, n in zip(outs, toks)]


def run_engine(path, dtype, reqs, args):
    from genpool.engine import LLM, SamplingParams

    llm = LLM(str(path), dtype=dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens)
    warm = [{"prompt_token_ids": reqs[0].prompt_token_ids[:32]}] * 2
    llm.generate(warm, [SamplingParams(temperature=0, max_tokens=4)] * 2)  # warm-up
    prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in reqs]
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens) for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    gens = [list(o.outputs[0].token_ids) for o in outs]
    toks = [len(g) for g in gens]
    stats = {}
    try:
        stats = dict(llm.llm_engine.stats())
    except Exception as e:  # engine without stats(): still report throughput
        stats = {"error": repr(e)}
    del llm
    return dt, toks, gens, stats


def floor_report(args, summary: dict) -> str:
    """Each mode against the hardware's floor (benchmarks/floor.py) and genpool against llama.cpp."""
    from transformers import AutoTokenizer

    from benchmarks import floor
    path = resolve_model(args.model)
    reqs = build_workload(AutoTokenizer.from_pretrained(str(path)), args.num_requests, args.seed)
    args.peaks = floor.measure_peaks()  # kept in the --json output's args
    return floor.floor_table(summary, str(path), sum(r.prompt_len for r in reqs), len(reqs), args.peaks)


def run_modes(args) -> int:
    import tempfile

    from benchmarks import quant_modes
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; copy bandwidth "
          f"{measure_copy_bandwidth() / 1e9:.1f} GB/s", flush=True)
    if args.modes_dir:  # each run's JSON kept there
        os.makedirs(args.modes_dir, exist_ok=True)
        summary = quant_modes.compare(args, args.modes.split(","), args.rounds, args.modes_dir)
    else:
        with tempfile.TemporaryDirectory(prefix="genpool-modes-") as tmp:
            summary = quant_modes.compare(args, args.modes.split(","), args.rounds, tmp)
    print(quant_modes.table(summary))
    print(quant_modes.quality_table(summary))
    print(floor_report(args, summary))
    print("CPU features:", ", ".join(next(iter(summary.values()))["cpu_features"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(modes=summary, args=vars(args), loadavg_end=os.getloadavg()), f, indent=1)
        print(f"wrote {args.json}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "both"], default="float32")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--skip-hf-single", action="store_true", help="skip (a), the slow baseline")
    ap.add_argument("--skip-hf-batched", action="store_true", help="skip (b)")
    ap.add_argument("--skip-engine", action="store_true", help="skip (c)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write results to this file")
    ap.add_argument("--modes", default=None, help="weight modes side by side instead of the systems above, e.g. "
                    "fp32,bf16,int8,q4_1 (benchmarks/quant_modes.py: one process per mode and round)")
    ap.add_argument("--rounds", type=int, default=2, help="with --modes: runs per mode, order reversed each round")
    ap.add_argument("--modes-dir", default=None, help="with --modes: keep each run's JSON in this directory")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.modes:
        return run_modes(args)

    from transformers import AutoTokenizer

    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(str(path))
    reqs = build_workload(tok, args.num_requests, args.seed)
    wstats = workload_stats(reqs)
    print(f"model {path}  threads {torch.get_num_threads()}  workload: {wstats['num_requests']} requests, "
          f"prompt tokens {wstats['prompt_tokens_total']} (len {wstats['prompt_len_min']}-"
          f"{wstats['prompt_len_max']}, mean {wstats['prompt_len_mean']:.0f}), max_tokens "
          f"{wstats['max_tokens_min']}-{wstats['max_tokens_max']} (sum {wstats['max_tokens_total']})", flush=True)
    load0 = os.getloadavg()
    if load0[0] > 1.5:
        print(f"WARNING: load average {load0[0]:.1f} on {os.cpu_count()} CPUs: other processes compete for "
              f"the cores, figures will be noisy (with OMP_WAIT_POLICY unset, {args.threads} spinning "
              f"OpenMP threads can slow down several-fold; OMP_WAIT_POLICY=PASSIVE helps)", flush=True)
    bw = measure_copy_bandwidth()
    print(f"copy bandwidth (read+write): {bw / 1e9:.1f} GB/s", flush=True)

    dtypes = ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]
    rows, extra = [], {"copy_bandwidth_GBps": bw / 1e9, "per_dtype": {}}
    for dtype in dtypes:
        info = extra["per_dtype"].setdefault(dtype, {})
        ref = {}  # system -> generated ids, to report agreement with (a)/(b)
        if not (args.skip_hf_single and args.skip_hf_batched):
            model, eos_ids = load_hf(path, dtype)
            wb = weight_bytes(model)
            info.update(weight_bytes=wb, decode_floor_ms=1e3 * wb / bw)
            if not args.skip_hf_single:
                print(f"[{dtype}] (a) HF one at a time ...", flush=True)
                dt, toks, gens = run_hf_single(model, eos_ids, reqs)
                rows.append(dict(system="hf-single", dtype=dtype, seconds=dt, tokens=sum(toks), per_request_tokens=toks))
                ref["hf-single"] = gens
            if not args.skip_hf_batched:
                print(f"[{dtype}] (b) HF static batches of {args.hf_batch_size} ...", flush=True)
                dt, toks, gens = run_hf_batched(model, eos_ids, reqs, args.hf_batch_size)
                rows.append(dict(system=f"hf-batch{args.hf_batch_size}", dtype=dtype, seconds=dt,
                                 tokens=sum(toks), per_request_tokens=toks))
                ref["hf-batched"] = gens
            del model
            gc.collect()
        if not args.skip_engine:
            print(f"[{dtype}] (c) genpool engine ...", flush=True)
            try:
                dt, toks, gens, stats = run_engine(path, dtype, reqs, args)
            except ImportError as e:
                print(f"  engine unavailable: {e}", flush=True)
            else:
                rows.append(dict(system="genpool", dtype=dtype, seconds=dt, tokens=sum(toks), per_request_tokens=toks))
                ref["genpool"] = gens
                info["engine_stats"] = stats
                if isinstance(stats, dict) and stats.get("decode_step_time_mean") is not None:
                    info["engine_decode_step_ms"] = 1e3 * float(stats["decode_step_time_mean"])
            gc.collect()
        base = ref.get("hf-single") or ref.get("hf-batched")
        if base is not None:
            for name, gens in ref.items():
                same = sum(a == b for a, b in zip(gens, base))
                info.setdefault("identical_to_baseline", {})[name] = f"{same}/{len(base)}"

    for r in rows:
        r["requests"] = len(reqs)
        r["tok_s"] = r["tokens"] / r["seconds"]
    for r in rows:
        for key, sysname in (("vs_a", "hf-single"), ("vs_b", f"hf-batch{args.hf_batch_size}")):
            b = next((x for x in rows if x["system"] == sysname and x["dtype"] == r["dtype"]), None)
            r[key] = r["tok_s"] / b["tok_s"] if b else None

    fmt = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
    print()
    print(f"{'system':<12} {'dtype':<9} {'requests':>8} {'out tokens':>10} {'seconds':>9} {'tok/s':>8} "
          f"{'vs (a)':>8} {'vs (b)':>8}")
    for r in rows:
        print(f"{r['system']:<12} {r['dtype']:<9} {r['requests']:>8} {r['tokens']:>10} {r['seconds']:>9.1f} "
              f"{r['tok_s']:>8.1f} {fmt(r['vs_a']):>8} {fmt(r['vs_b']):>8}")
    print()
    for dtype, info in extra["per_dtype"].items():
        parts = []
        if "decode_floor_ms" in info:
            parts.append(f"weights {info['weight_bytes'] / 1e6:.0f} MB -> decode-step bandwidth floor "
                         f"{info['decode_floor_ms']:.1f} ms ({1e3 / info['decode_floor_ms']:.0f} steps/s)")
        if "engine_decode_step_ms" in info:
            parts.append(f"engine mean decode step {info['engine_decode_step_ms']:.1f} ms")
        if "identical_to_baseline" in info:
            parts.append("identical outputs vs baseline: " + ", ".join(
                f"{k} {v}" for k, v in info["identical_to_baseline"].items()))
        if parts:
            print(f"[{dtype}] " + "; ".join(parts))

    if args.json:
        out = dict(rows=rows, workload=wstats, **extra, loadavg_start=load0, loadavg_end=os.getloadavg(),
                   omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"), host=dict(
            platform=platform.platform(), cpus=os.cpu_count(), threads=torch.get_num_threads(),
            torch=torch.__version__), args=vars(args))
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
