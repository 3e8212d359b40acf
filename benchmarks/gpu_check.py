"""The checks of benchmarks/gpu_check.sh, one subcommand each; every check appends rows (JSON lines)
to --rows, and `table` prints them as one table.

  checkpoints --out DIR [--smoke]     random-weight checkpoints built on the device (gpu_checkpoints.py)
  parity --model P                    engine greedy tokens + logprobs: Triton backend vs torch reference (fp32)
  throughput --model P                engine (Triton, bf16) vs HF generate in static batches, same workload
  bandwidth [--peak-gbs 4800]         paged attention: bytes moved per second vs the card's peak
  table                               the rows so far

--smoke: tiny shapes and workloads, for the CPU under TRITON_INTERPRET=1 (tests/integration/test_gpu_check.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.append(ROOT)

import torch  # noqa: E402

# name, num_seqs, q_len, kv_len, q heads, kv heads, head_dim. Decode shapes are memory-bound
# and what the bandwidth ratio is about; the prefill row is compute-bound (TFLOP/s shown).
BENCH_SHAPES = [
    ("smollm2 decode", 256, 1, 1024, 9, 3, 64),
    ("1B decode", 128, 1, 2048, 32, 8, 64),
    ("few long seqs", 8, 1, 16384, 32, 8, 128),
    ("prefill chunks", 4, 512, 2048, 32, 8, 128),
]
SMOKE_SHAPES = [("tiny decode", 2, 1, 40, 4, 2, 16)]
NEAR_TIE = 1e-3  # fp32: backends may order sums differently; a flip between near-tied tokens is allowed


def add_row(rows: str, check: str, model: str, value: str, ok: bool | None = None) -> None:
    row = dict(check=check, model=model, value=value, status={None: "info", True: "PASS", False: "FAIL"}[ok])
    print(f"{row['status']:<5} {check:<28} {model:<16} {value}", flush=True)
    with open(rows, "a") as f:
        f.write(json.dumps(row) + "\n")


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def prompts(vocab: int, n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lens]


def engine(path: str, device: str, backend: str, dtype: str, **kw):
    from genpool.engine import LLM

    return LLM(path, device=device, kernel_backend=backend, dtype=dtype, **kw)


def parity(a) -> int:
    """Greedy tokens of the Triton engine equal the reference's, or part at a near-tie."""
    from genpool.engine import SamplingParams

    vocab = json.loads((Path(a.model) / "config.json").read_text())["vocab_size"]
    ps = prompts(vocab, 2 if a.smoke else 6, 5, 20 if a.smoke else 300)
    params = SamplingParams(temperature=0, max_tokens=3 if a.smoke else 24, ignore_eos=True, logprobs=2)
    runs = {}
    for backend in ("torch", "triton"):
        llm = engine(a.model, a.device, backend, "float32", num_kv_blocks=64 if a.smoke else 4096)
        runs[backend] = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in ps], params)]
        del llm
    same, worst = 0, 0.0
    for ref, tri in zip(runs["torch"], runs["triton"]):
        div = next((i for i, (x, y) in enumerate(zip(ref.token_ids, tri.token_ids)) if x != y), None)
        upto = len(ref.token_ids) if div is None else div
        worst = max([worst] + [abs(r[t] - q[t]) for r, q, t in zip(ref.logprobs[:upto], tri.logprobs[:upto],
                                                                    ref.token_ids[:upto])])
        if div is None:
            same += 1
        else:  # allowed only between near-tied tokens of the reference
            top = sorted(ref.logprobs[div].values(), reverse=True)
            same += len(top) > 1 and top[0] - top[1] < NEAR_TIE
    ok = same == len(ps) and worst < 1e-2
    add_row(a.rows, "parity triton=ref fp32", Path(a.model).name,
            f"{same}/{len(ps)} prompts, max |dlogprob| {worst:.1e}", ok)
    return 0 if ok else 1


def _hf_batches(model, reqs, max_tokens: int, batch: int, device: str) -> None:
    for s in range(0, len(reqs), batch):
        group = reqs[s:s + batch]
        width = max(map(len, group))
        ids = torch.zeros((len(group), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(group):  # left padding
            ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
        model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_tokens,
                       min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)


def throughput(a) -> int:
    from transformers import AutoModelForCausalLM

    from genpool.engine import SamplingParams

    vocab = json.loads((Path(a.model) / "config.json").read_text())["vocab_size"]
    n, max_tokens, batch = (4, 4, 2) if a.smoke else (256, 128, 64)
    reqs = prompts(vocab, n, 8 if a.smoke else 128, 16 if a.smoke else 512, seed=1)
    backend = "triton" if a.device.startswith("cuda") or a.smoke else "torch"
    llm = engine(a.model, a.device, backend, a.dtype, max_num_seqs=n, max_num_batched_tokens=8192,
                 **({"num_kv_blocks": 64} if a.smoke else {"gpu_memory_utilization": 0.5}))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": reqs[0]}] * 2, params)  # warm-up (Triton compiles here)
    sync(a.device)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in reqs], params)
    sync(a.device)
    eng_s = time.perf_counter() - t0
    assert sum(len(o.outputs[0].token_ids) for o in outs) == n * max_tokens
    del llm, outs
    if a.device.startswith("cuda"):
        torch.cuda.empty_cache()
    hf = AutoModelForCausalLM.from_pretrained(a.model, dtype=getattr(torch, a.dtype)).to(a.device).eval()
    with torch.inference_mode():
        _hf_batches(hf, reqs[:2], 2, 2, a.device)  # warm-up
        sync(a.device)
        t0 = time.perf_counter()
        _hf_batches(hf, reqs, max_tokens, batch, a.device)
        sync(a.device)
    hf_s = time.perf_counter() - t0
    tokens = n * max_tokens
    add_row(a.rows, f"throughput {a.dtype} {backend}", Path(a.model).name,
            f"engine {tokens / eng_s:.0f} tok/s, HF batch{batch} {tokens / hf_s:.0f} tok/s: "
            f"{hf_s / eng_s:.2f}x ({n} req x {max_tokens} tok)")
    return 0


def _time(fn, device: str, reps: int) -> float:
    """Milliseconds per call (CUDA: triton's do_bench; CPU smoke: wall clock)."""
    if device.startswith("cuda"):
        from triton.testing import do_bench

        return do_bench(fn, warmup=10, rep=50)
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return 1e3 * (time.perf_counter() - t0) / reps


def bandwidth(a) -> int:
    from genpool.kernels import ref
    from genpool.kernels.triton.paged_attention import paged_attention

    dtype = torch.float32 if a.smoke else torch.bfloat16
    ok = True
    for name, s, ql, kl, hq, hkv, d in SMOKE_SHAPES if a.smoke else BENCH_SHAPES:
        bs, nb = 16, -(-kl // 16)
        k_cache = torch.randn(s * nb, bs, hkv, d, device=a.device, dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        tables = torch.randperm(s * nb, device=a.device).view(s, nb).to(torch.int32)
        q = torch.randn(s * ql, hq, d, device=a.device, dtype=dtype)
        qsl = torch.arange(0, s + 1, device=a.device, dtype=torch.int32) * ql
        lens = torch.full((s,), kl, device=a.device, dtype=torch.int32)
        args = (q, k_cache, v_cache, tables, qsl, lens, d ** -0.5)
        err = (paged_attention(*args).float() - ref.paged_attention(*args).float()).abs().max().item()
        ok &= err < (1e-4 if dtype == torch.float32 else 3e-2)
        nbytes = 2 * s * kl * hkv * d * q.element_size() + 2 * q.numel() * q.element_size()
        best = min((_time(lambda: paged_attention(*args, block_n=bn), a.device, 2), bn)
                   for bn in ((32,) if a.smoke else (16, 32, 64, 128)))
        gbs = nbytes / best[0] / 1e6
        add_row(a.rows, f"attention {name}", "-", f"{gbs:.0f} GB/s = {gbs / a.peak_gbs:.2f} of peak "
                f"(block_n {best[1]}, {best[0]:.3f} ms); max |triton-ref| {err:.1e}", err < 3e-2)
    return 0 if ok else 1


def table(a) -> int:
    rows = [json.loads(line) for line in open(a.rows)] if os.path.exists(a.rows) else []
    print(f"{'status':<6} {'check':<28} {'model':<16} value")
    for r in rows:
        print(f"{r['status']:<6} {r['check']:<28} {r['model']:<16} {r['value']}")
    return 0 if rows and all(r["status"] != "FAIL" for r in rows) else 1


def checkpoints(a) -> int:
    from benchmarks.gpu_checkpoints import FULL, SMOKE, build

    for name in SMOKE if a.smoke else FULL:
        t0 = time.perf_counter()
        print(build(name, Path(a.out), a.device), f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", choices=["checkpoints", "parity", "throughput", "bandwidth", "table"])
    ap.add_argument("--rows", default="gpu_check_out/rows.jsonl")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes for the CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--model", help="checkpoint dir (parity, throughput)")
    ap.add_argument("--dtype", default="bfloat16", help="throughput dtype")
    ap.add_argument("--out", default="gpu_check_out/models", help="checkpoints: where to write")
    ap.add_argument("--peak-gbs", type=float, default=4800.0, help="peak HBM GB/s (H200: 4800)")
    a = ap.parse_args(argv)
    if a.cmd != "table" and a.device.startswith("cuda") and not torch.cuda.is_available():
        print("CUDA is not available: use --smoke --device cpu for the CPU dry run", file=sys.stderr)
        return 2
    torch.set_grad_enabled(False)
    return {"checkpoints": checkpoints, "parity": parity, "throughput": throughput, "bandwidth": bandwidth,
            "table": table}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
