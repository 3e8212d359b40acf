"""GPU checks for the Triton kernels (run by benchmarks/gpu_check.sh on a CUDA machine).

  python benchmarks/gpu_check.py bandwidth [--peak-gbs 4800]
      Paged-attention micro-benchmark: bytes of Q + K/V read + output written per call over the
      kernel's time, against the card's peak HBM bandwidth (H200 datasheet: 4.8 TB/s).
  python benchmarks/gpu_check.py parity --model PATH [--tokens 32]
      Greedy token parity of the engine on CUDA (triton and torch kernel backends) against
      a plain HF transformers greedy loop.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

# name, num_seqs, q_len, kv_len, q heads, kv heads, head_dim. Decode shapes are memory-bound
# and what the bandwidth ratio is about; the prefill row is compute-bound (TFLOP/s shown).
BENCH_SHAPES = [
    ("smollm2 decode", 256, 1, 1024, 9, 3, 64),
    ("8B-like decode", 128, 1, 2048, 32, 8, 128),
    ("few long seqs", 8, 1, 16384, 32, 8, 128),
    ("prefill chunks", 4, 512, 2048, 32, 8, 128),
]


def make_inputs(num_seqs, q_len, kv_len, hq, hkv, d, block_size=16, dtype=torch.bfloat16):
    dev = "cuda"
    blocks_per_seq = -(-kv_len // block_size)
    num_blocks = num_seqs * blocks_per_seq
    k_cache = torch.randn(num_blocks, block_size, hkv, d, device=dev, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks, device=dev).view(num_seqs, blocks_per_seq).to(torch.int32)
    q = torch.randn(num_seqs * q_len, hq, d, device=dev, dtype=dtype)
    qsl = torch.arange(0, num_seqs + 1, device=dev, dtype=torch.int32) * q_len
    seq_lens = torch.full((num_seqs,), kv_len, device=dev, dtype=torch.int32)
    return q, k_cache, v_cache, tables, qsl, seq_lens


def bench_bandwidth(peak_gbs: float) -> int:
    from triton.testing import do_bench

    from kernels import ref
    from kernels.triton_paged_attention import paged_attention

    print(f"{'shape':<16} {'block_n':>7} {'ms':>9} {'GB/s':>8} {'ratio':>6} {'TFLOP/s':>8}")
    for name, s, ql, kl, hq, hkv, d in BENCH_SHAPES:
        args = make_inputs(s, ql, kl, hq, hkv, d)
        q, k_cache = args[0], args[1]
        scale = d ** -0.5
        elem = q.element_size()
        nbytes = 2 * s * kl * hkv * d * elem + 2 * q.numel() * elem  # K+V, Q read + out written
        # causal pairs: each query row sees its prefix plus the part of its chunk up to itself
        pairs = s * hq * (ql * (kl - ql) + ql * (ql + 1) // 2)
        flops = 4 * pairs * d
        if name == BENCH_SHAPES[0][0]:
            err = (paged_attention(*args, scale).float()
                   - ref.paged_attention(*args, scale).float()).abs().max().item()
            ref_ms = do_bench(lambda: ref.paged_attention(*args, scale), warmup=5, rep=30)
            print(f"  sanity: max |triton - ref| = {err:.3e}; torch reference {ref_ms:.3f} ms")
        for block_n in (16, 32, 64, 128):
            ms = do_bench(lambda: paged_attention(*args, scale, block_n=block_n), warmup=10, rep=50)
            gbs = nbytes / ms / 1e6
            print(f"{name:<16} {block_n:>7} {ms:>9.4f} {gbs:>8.0f} {gbs / peak_gbs:>6.2f} "
                  f"{flops / ms / 1e9:>8.1f}")
        del args, q, k_cache
        torch.cuda.empty_cache()
    return 0


def hf_greedy(model, prompt_ids, max_tokens, device):
    """Plain greedy loop without a KV cache: slow but free of any generate() API drift."""
    ids = torch.tensor([prompt_ids], device=device)
    out = []
    with torch.no_grad():
        for _ in range(max_tokens):
            nxt = model(input_ids=ids).logits[0, -1].argmax().item()
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]], device=device)], dim=1)
    return out


def first_divergence(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three primary colors:",
    "Water boils at a temperature of",
    "The quick brown fox",
]


def parity(model_path: str, max_tokens: int, dtype: str, device: str = "cuda") -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine import LLM, SamplingParams

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    tok = AutoTokenizer.from_pretrained(model_path)
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype).to(device).eval()
    expected = [hf_greedy(hf, ids, max_tokens, device) for ids in prompt_ids]
    del hf
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    failures = 0
    for backend in ("triton", "torch"):
        llm = LLM(model_path, dtype=dtype, device=device, kernel_backend=backend)
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)
        matched = 0
        for prompt, want, out in zip(PROMPTS, expected, outs):
            got = list(out.outputs[0].token_ids)
            div = first_divergence(got, want)
            matched += div is None
            if div is not None:
                print(f"  [{backend}] {prompt!r}: diverges at token {div}: "
                      f"engine {tok.decode(got)!r} vs HF {tok.decode(want)!r}")
        print(f"parity {dtype} backend={backend}: {matched}/{len(PROMPTS)} prompts identical "
              f"for {max_tokens} greedy tokens")
        failures += matched != len(PROMPTS)
        del llm
    # bf16 greedy can legitimately flip near-tied tokens; only fp32 parity is a pass/fail gate.
    return 1 if failures and dtype == "float32" else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    bw = sub.add_parser("bandwidth")
    bw.add_argument("--peak-gbs", type=float, default=4800.0, help="peak HBM GB/s (H200: 4800)")
    pa = sub.add_parser("parity")
    pa.add_argument("--model", required=True)
    pa.add_argument("--tokens", type=int, default=32)
    pa.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    pa.add_argument("--device", default="cuda", help="cpu only for a dry run under TRITON_INTERPRET=1")
    args = ap.parse_args(argv)
    if args.cmd == "parity" and args.device == "cpu":
        return parity(args.model, args.tokens, args.dtype, "cpu")
    if not torch.cuda.is_available():
        print("CUDA is not available: these checks need a GPU", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if args.cmd == "bandwidth":
        return bench_bandwidth(args.peak_gbs)
    return parity(args.model, args.tokens, args.dtype, args.device)


if __name__ == "__main__":
    sys.exit(main())
