"""Weight modes side by side (benchmarks/throughput.py --modes): fp32, bf16, int8 (at load) and the
shipped Q4_1 GGUF loaded natively, each in its own process (so each has its own RSS), in rounds
whose order alternates, on the same 48-request mix.

Per mode: throughput over the mix, the mean decode step at batch 1, the process RSS (before the
model, after loading, peak), the CPU features the kernels were built for, and quality against
fp32 on text the benchmark writes itself (benchmarks/workload.py's hand-written paragraphs,
teacher-forced): per-token KL(fp32 || mode), perplexity, top-1 agreement; plus how many of the
mix's greedy outputs are identical to fp32's.

  python benchmarks/quant_modes.py --mode int8 --out r.json [--fp32-logprobs lp.pt]   (one mode)
"""
from __future__ import annotations

import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, last: benchmarks.* and tests.* only, installed packages first

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import time  # noqa: E402
from types import SimpleNamespace  # noqa: E402

from genpool.schemas.settings import bound_openmp_spinning  # noqa: E402

bound_openmp_spinning()  # as the genpool worker runs (before torch loads); a policy in the env wins

import torch  # noqa: E402

MODES = {"fp32": dict(dtype="float32"), "bf16": dict(dtype="bfloat16"),
         "int8": dict(dtype="float32", quantization="int8"), "q4_1": dict(dtype="float32", quantization="gguf")}
# The same weights through the widening kernel (fp32 FMAs, bf16 prompt products on bf16 hardware),
# the default before the VNNI int8 kernel: kernels/cpu/qgemm.py compute_mode().
MODES.update({"int8-widen": MODES["int8"], "q4_1-widen": MODES["q4_1"]})
# The same weights over a bf16 KV cache (EngineConfig.kv_cache_dtype): half the K/V bytes.
MODES.update({f"{m}-kvbf16": dict(MODES[m], kv_cache_dtype="bfloat16") for m in ("fp32", "int8", "q4_1")})
# ... or an int8 one (kernels/kvq.py: a scale per group of 32): 72 bytes a vector of 64, 0.28x fp32's.
MODES.update({f"{m}-kvint8": dict(MODES[m], kv_cache_dtype="int8") for m in ("fp32", "int8", "q4_1")})
MODE_ENV = {m: {"GENPOOL_QUANT_COMPUTE": "bf16"} for m in ("int8-widen", "q4_1-widen")}
# int8 with its products of 32+ rows on AMX tiles (opt-in: kernels/cpu/qgemm.py compute_mode()).
MODES.update({"int8-amx": MODES["int8"], "int8-amx-kvbf16": MODES["int8-kvbf16"]})
MODE_ENV.update({m: {"GENPOOL_QUANT_COMPUTE": "amx"} for m in ("int8-amx", "int8-amx-kvbf16")})
SCORE_TOKENS = 128  # tokens per scored paragraph
KV_BLOCKS = 2048  # the same KV cache in every mode (its resident part is subtracted from the RSS compared)
FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def resident_bytes(tensors) -> int:
    """Resident bytes of the memory mappings that hold these tensors (/proc/self/smaps Rss): the KV
    cache lives on lazily backed anonymous mappings (engine/cpu_alloc.py lazy_zeros), resident only
    as far as it has been written; each mapping counted once."""
    ptrs = [t.data_ptr() for t in tensors]
    found, total, cur = set(), 0, None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                cur = (lo, hi) if any(lo <= p < hi for p in ptrs) and (lo, hi) not in found else None
            elif head == "Rss:" and cur is not None:
                found.add(cur)
                total += int(line.split()[1]) * 1024
    return total


def kv_resident(llm) -> int:
    return resident_bytes([t for pair in llm.llm_engine.runner.kv_caches for t in pair])


def cpu_features() -> list[str]:
    from genpool.kernels.cpu import build as cpu_build
    return [f for f in FEATURES if cpu_build.cpu_has(f)]


def decode_step_batch1(llm, prompt: list[int], steps: int = 64, reps: int = 3) -> float:
    """Mean decode step (s) of one request alone, best of `reps` runs."""
    from genpool.engine import SamplingParams
    eng, best = llm.llm_engine, float("inf")
    for _ in range(reps):
        before = dict(eng._counters)
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
        n = eng._counters["decode_steps"] - before["decode_steps"]
        best = min(best, (eng._counters["decode_time_total"] - before["decode_time_total"]) / max(n, 1))
    return best


class _Text(SimpleNamespace):
    """A text run through the runner outside the scheduler: the fields and calls model_runner.prepare
    and engine/step_rows.py read of a Sequence (no prompt scoring, no draft)."""

    def step_token_ids(self, n: int) -> list[int]:
        return self.token_ids[self.num_computed_tokens:self.num_computed_tokens + n]

    def prompt_score_rows(self, n: int) -> range:
        return range(0)


@torch.inference_mode()
def score(llm, texts: list[list[int]]) -> torch.Tensor:
    """Teacher-forced log-probs [B, L - 1, V] of every next token of the texts (equal lengths L),
    one token per sequence per step through the engine's runner. Runs on blocks the block manager
    does not know of: only on an idle engine that is discarded afterwards."""
    runner = llm.llm_engine.runner
    n_blocks = -(-len(texts[0]) // runner.block_size)
    seqs = [_Text(token_ids=t[:1], num_computed_tokens=0, num_tokens=1,
                            block_table=list(range(i * n_blocks, (i + 1) * n_blocks))) for i, t in enumerate(texts)]
    out = []
    for pos in range(len(texts[0]) - 1):
        out.append(torch.log_softmax(runner.execute([(s, 1) for s in seqs], []).float(), dim=-1))
        for s, t in zip(seqs, texts):
            s.num_computed_tokens += 1
            s.token_ids = t[:pos + 2]
            s.num_tokens = pos + 2
    return torch.stack(out, dim=1)


@torch.inference_mode()
def score_prefill(llm, texts: list[list[int]]) -> torch.Tensor:
    """The same log-probs [B, L - 1, V], the texts run as prompts: one prefill step over all of them
    (prompt-sized products: bf16 ones where a quantized mode takes them), every row's logits."""
    runner = llm.llm_engine.runner
    n_blocks = -(-len(texts[0]) // runner.block_size)
    seqs = [_Text(token_ids=list(t), num_computed_tokens=0, num_tokens=len(t),
                            block_table=list(range(i * n_blocks, (i + 1) * n_blocks))) for i, t in enumerate(texts)]
    ids, pos, meta, _ = runner.prepare([(s, len(s.token_ids)) for s in seqs])
    meta.keep = None  # every row's hidden state, not only the last of each prompt
    hidden = runner.model(ids, pos, runner.kv_caches, meta)
    logits = runner.model.compute_logits(hidden).float().view(len(texts), len(texts[0]), -1)
    return torch.log_softmax(logits[:, :-1], dim=-1)


def quality(logp: torch.Tensor, texts: list[list[int]], ref: torch.Tensor | None) -> dict:
    nxt = torch.tensor([t[1:] for t in texts])
    nll = -logp.gather(-1, nxt.unsqueeze(-1)).squeeze(-1)
    q = dict(perplexity=float(nll.mean().exp()), scored_tokens=int(nll.numel()))
    if ref is not None:
        ref = ref.float()
        kl = (ref.exp() * (ref - logp)).sum(-1)  # KL(fp32 || mode) per token
        q.update(kl_mean=float(kl.mean()), kl_p99=float(kl.flatten().quantile(0.99)), kl_max=float(kl.max()),
                 top1_agreement=float((ref.argmax(-1) == logp.argmax(-1)).float().mean()),
                 fp32_perplexity=float((-ref.gather(-1, nxt.unsqueeze(-1))).mean().exp()))
    return q


def scored(llm, texts: list[list[int]], mode: str, fp32_logprobs: str) -> dict:
    """Quality on the texts, teacher-forced one token per step (decode-sized products) and as one
    prefill (prompt-sized ones); fp32 saves its log-probs for the other modes' KL."""
    out = {}
    for key, fn in (("quality", score), ("quality_prefill", score_prefill)):
        logp, path = fn(llm, texts), f"{fp32_logprobs}.{key}"
        ref = None
        if mode == "fp32":
            torch.save(logp.half(), path)
        elif os.path.exists(path):
            ref = torch.load(path).float()
        out[key] = quality(logp, texts, ref)
    return out


def measure(llm, reqs) -> dict:
    """Batch-1 decode step, then the whole mix at once: seconds, tokens, outputs, RSS after."""
    from genpool.engine import SamplingParams
    res = {}
    warm = [{"prompt_token_ids": reqs[0].prompt_token_ids[:32]}] * 2
    llm.generate(warm, [SamplingParams(temperature=0, max_tokens=4)] * 2)
    res["decode_step_batch1_ms"] = 1e3 * decode_step_batch1(llm, list(reqs[0].prompt_token_ids[:64]))
    prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in reqs]
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens) for r in reqs]
    before = dict(llm.llm_engine._counters)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    res["seconds"] = time.perf_counter() - t0
    c = llm.llm_engine._counters
    res["decode_step_mix_ms"] = 1e3 * (c["decode_time_total"] - before["decode_time_total"]) / max(
        1, c["decode_steps"] - before["decode_steps"])
    res["gens"] = [list(o.outputs[0].token_ids) for o in outs]
    res["tokens"] = sum(len(g) for g in res["gens"])
    res["tok_s"] = res["tokens"] / res["seconds"]
    res["rss_after_run"] = rss_bytes()
    res["kv_resident_after_run"] = kv_resident(llm)
    return res


def products(llm, cpu_qgemm) -> str:
    """How the quantized layers multiply, from the layouts they were packed in: "vnni" (integer dot
    products), "amx+vnni" (products of 32+ rows on AMX tiles, the rest on dots), the widening
    kernel's "fp32" / "bf16", or several joined by "+" where they differ (a model whose layers mix widths or groups)."""
    widen = "bf16" if cpu_qgemm.bf16_prefill() else "fp32"
    kinds = {("amx+vnni" if m.packed.struct.amx else "vnni") if m.packed.layout == "vnni" else widen
             for m in llm.llm_engine.runner.model.modules()
             if isinstance(getattr(m, "packed", None), cpu_qgemm.QPackedWeight)}
    return "+".join(sorted(kinds)) or widen


def run_mode(mode: str, model: str, num_requests: int, seed: int, max_num_seqs: int, max_batched: int,
             fp32_logprobs: str | None, throughput: bool = True) -> dict:
    from transformers import AutoTokenizer

    from benchmarks.workload import PARAGRAPHS, build_workload
    from genpool.engine import LLM
    from genpool.engine.models.registry import resolve_model
    path = resolve_model(model)
    tok = AutoTokenizer.from_pretrained(str(path))
    reqs = build_workload(tok, num_requests, seed)
    pairs = [PARAGRAPHS[i] + "\n\n" + PARAGRAPHS[(i + 1) % len(PARAGRAPHS)] for i in range(len(PARAGRAPHS))]
    texts = [t for t in (tok(p)["input_ids"][:SCORE_TOKENS] for p in pairs) if len(t) == SCORE_TOKENS][:8]
    from genpool.kernels.cpu import qgemm as cpu_qgemm
    quantized = "quantization" in MODES[mode]
    res = dict(mode=mode, cpu_features=cpu_features(), rss_before_model=rss_bytes(),
               omp_wait=os.environ.get("OMP_WAIT_POLICY") or f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}")
    t0 = time.perf_counter()
    llm = LLM(str(path), num_kv_blocks=KV_BLOCKS, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched,
              **MODES[mode])
    res["load_seconds"] = time.perf_counter() - t0
    res["quant_compute"] = products(llm, cpu_qgemm) if quantized else None
    res["rss_loaded"] = rss_bytes()
    runner = llm.llm_engine.runner
    res["kv_bytes"] = runner.num_blocks * runner.bytes_per_block  # reserved (resident as far as written)
    res["kv_resident_loaded"] = kv_resident(llm)
    if throughput:
        res.update(measure(llm, reqs))
    if fp32_logprobs is not None:
        res.update(scored(llm, texts, mode, fp32_logprobs))
    res["rss_peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=sorted(MODES), required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fp32-logprobs", default=None, help="fp32 writes its teacher-forced log-probs here; "
                                                          "other modes read them for KL (omit: no quality run)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--quality-only", action="store_true", help="load and score; no throughput run")
    a = ap.parse_args(argv)
    os.environ.update(MODE_ENV.get(a.mode, {}))  # read once, at the first quantized product
    torch.set_num_threads(a.threads)
    res = run_mode(a.mode, a.model, a.num_requests, a.seed, a.max_num_seqs, a.max_num_batched_tokens,
                   a.fp32_logprobs, throughput=not a.quality_only)
    with open(a.out, "w") as f:
        json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())


def _child(mode: str, a, out: str, logprobs: str | None) -> dict:
    import subprocess
    if mode.startswith("llamacpp"):  # peer rows: llama.cpp's server on the same weights (llamacpp_peer.py)
        peer = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llamacpp_peer.py")
        kind = mode.partition("-")[2] or "q4_1"  # llamacpp, llamacpp-f32, llamacpp-q8_0, llamacpp-q4_1
        subprocess.run([sys.executable, peer, "--model", a.model, "--num-requests", str(a.num_requests),
                        "--seed", str(a.seed), "--threads", str(a.threads), "--type", kind, "--out", out],
                       check=True)
        with open(out) as f:
            return json.load(f)
    cmd = [sys.executable, os.path.abspath(__file__), "--mode", mode, "--model", a.model, "--num-requests",
           str(a.num_requests), "--seed", str(a.seed), "--max-num-seqs", str(a.max_num_seqs),
           "--max-num-batched-tokens", str(a.max_num_batched_tokens), "--threads", str(a.threads), "--out", out]
    if logprobs:
        cmd += ["--fp32-logprobs", logprobs]
    subprocess.run(cmd, check=True)
    with open(out) as f:
        return json.load(f)


def compare(a, modes: list[str], rounds: int, workdir: str) -> dict:
    """Every mode in its own process, `rounds` times, the order reversed each round (fp32 first in
    the first, for the quality reference); quality is scored in the first round."""
    if "fp32" not in modes:
        raise ValueError("--modes must include fp32 (the reference)")
    order = ["fp32"] + [m for m in modes if m != "fp32"]
    runs: dict[str, list[dict]] = {m: [] for m in order}
    lp = os.path.join(workdir, "fp32_logprobs.pt")
    for r in range(rounds):
        for m in (order if r % 2 == 0 else order[::-1]):
            print(f"[round {r + 1}] {m} ...", flush=True)
            runs[m].append(_child(m, a, os.path.join(workdir, f"{m}-{r}.json"), lp if r == 0 else None))
    for key in ("quality", "quality_prefill"):
        if os.path.exists(f"{lp}.{key}"):
            os.unlink(f"{lp}.{key}")
    return summarize(runs)


def model_rss_bytes(r: dict) -> int:
    """RSS without KV and libraries: after the mix, less the RSS before the model was built (torch,
    transformers, the tokenizer) and less the KV cache's resident pages (runs before the KV cache
    was lazily backed, with no kv_resident_after_run, had it all resident: kv_bytes)."""
    return r["rss_after_run"] - r["rss_before_model"] - r.get("kv_resident_after_run", r["kv_bytes"])


def summarize(runs: dict[str, list[dict]]) -> dict:
    fp32 = runs["fp32"]
    base_tok_s = sum(x["tok_s"] for x in fp32) / len(fp32)
    base_step = min(x["decode_step_batch1_ms"] for x in fp32)
    base_rss = model_rss_bytes(fp32[0])
    out = {}
    for m, rs in runs.items():
        tok_s = [x["tok_s"] for x in rs]
        step = min(x["decode_step_batch1_ms"] for x in rs)
        same = sum(g == f for g, f in zip(rs[0]["gens"], fp32[0]["gens"]))
        model_rss = model_rss_bytes(rs[0])
        out[m] = dict(tok_s=tok_s, tok_s_mean=sum(tok_s) / len(tok_s), vs_fp32=sum(tok_s) / len(tok_s) / base_tok_s,
                      decode_step_batch1_ms=step, step_vs_fp32=step / base_step,
                      decode_step_mix_ms=[x["decode_step_mix_ms"] for x in rs],
                      rss_after_run_MB=rs[0]["rss_after_run"] / 1e6, rss_model_MB=model_rss / 1e6,
                      kv_MB=rs[0]["kv_bytes"] / 1e6,
                      kv_resident_MB=rs[0].get("kv_resident_after_run", rs[0]["kv_bytes"]) / 1e6,
                      rss_before_model_MB=rs[0]["rss_before_model"] / 1e6,
                      rss_model_vs_fp32=model_rss / base_rss, rss_peak_MB=rs[0]["rss_peak"] / 1e6,
                      identical_to_fp32=f"{same}/{len(fp32[0]['gens'])}", quality=rs[0].get("quality"),
                      quality_prefill=rs[0].get("quality_prefill"),
                      cpu_features=rs[0]["cpu_features"], tokens=[x["tokens"] for x in rs],
                      quant_compute=rs[0].get("quant_compute"))
    return out


def quality_table(summary: dict) -> str:
    """Quality against fp32 on the scored paragraphs, decode-sized and prompt-sized products apart."""
    lines = ["| mode | products | KL(fp32 || mode) mean / p99 / max | perplexity (fp32's) | top-1 agreement |",
             "|---|---|---|---|---|"]
    for m, s in summary.items():
        for key, label in (("quality", "decode-sized (1 token/step)"), ("quality_prefill", "prompt-sized (1 prefill)")):
            q = s.get(key) or {}
            if "kl_mean" in q:
                lines.append(f"| {m} | {label} | {q['kl_mean']:.5f} / {q['kl_p99']:.5f} / {q['kl_max']:.4f} | "
                             f"{q['perplexity']:.3f} ({q['fp32_perplexity']:.3f}) | {100 * q['top1_agreement']:.1f}% |")
    return "\n".join(lines)


def table(summary: dict) -> str:
    lines = ["| mode | tok/s (each round) | vs fp32 | decode step, batch 1 | vs fp32 | RSS after run | "
             "RSS of model+run (no KV) | vs fp32 | identical to fp32 | KL mean / p99 | ppl (fp32's) | top-1 agree |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m, s in summary.items():
        q = s["quality"] or {}
        kl = f"{q['kl_mean']:.4f} / {q['kl_p99']:.4f}" if "kl_mean" in q else "-"
        ppl = f"{q['perplexity']:.3f}" + (f" ({q['fp32_perplexity']:.3f})" if "fp32_perplexity" in q else "") \
            if q else "-"
        agree = f"{100 * q['top1_agreement']:.1f}%" if "top1_agreement" in q else "-"
        name = f"{m} ({s['quant_compute']} products)" if s.get("quant_compute") else m
        lines.append(f"| {name} | {' / '.join(f'{t:.1f}' for t in s['tok_s'])} | {s['vs_fp32']:.2f}x | "
                     f"{s['decode_step_batch1_ms']:.1f} ms | {s['step_vs_fp32']:.2f}x | {s['rss_after_run_MB']:.0f} MB | "
                     f"{s['rss_model_MB']:.0f} MB | {s['rss_model_vs_fp32']:.2f}x | {s['identical_to_fp32']} | {kl} | "
                     f"{ppl} | {agree} |")
    return "\n".join(lines)
