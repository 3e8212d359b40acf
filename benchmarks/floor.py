"""The hardware floor of a run of the mix (issue 34): the multiply-adds its linear layers need,
at the machine's measured peak multiply-add rate.

- Multiply-adds: every row that goes through the decoder (prompt tokens, plus every generated token
  but each request's last) costs the layers' weights, L x (H x (q + 2 kv heads) x D + q heads x D x H
  + 3 x H x I); every sampled row (one per generated token) costs the lm_head, H x V. Attention,
  norms and sampling are left out, so the floor is lower than anything can reach.
- Peak: benchmarks/cpu_peak.c (built here with the system compiler, -march=native), run on every
  core at once: the integer dot products the quantized kernels use (AVX512-VNNI's vpdpbusd, 64
  multiply-adds each, for int8 and int4; on AVX2, vpmaddubsw + vpmaddwd + vpaddd for int8 and
  vpmaddubsw + vpaddw for int4, 32 each), vfmadd231ps (fp32, 16 or 8) and, where the CPU has AMX,
  tdpbf16ps tiles (8192). int8 modes are held to the int8 peak (issue 34's floor), q4_1 to the int4
  one, fp32 to the FMA peak; the int8-amx modes (prompt products on AMX bf16 tiles) also give their
  share of a floor at the AMX bf16 peak.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PEAK_KIND = {"int8": "int8", "q4_1": "int4", "fp32": "fma"}  # a mode's products -> the peak it is held to


def measure_peaks(cores: int | None = None) -> dict:
    """{"int8", "int4", "fma", "amx_bf16": G MAC/s, "cores": n} over `cores` copies of cpu_peak run at
    once (default: every core); {} where no compiler is found."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return {}
    cores = cores or os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="genpool-peak-") as tmp:
        exe = os.path.join(tmp, "cpu_peak")
        subprocess.run([cc, "-O2", "-march=native", "-o", exe, os.path.join(HERE, "cpu_peak.c")], check=True)
        procs = [subprocess.Popen([exe], stdout=subprocess.PIPE, text=True) for _ in range(cores)]
        outs = [p.communicate()[0].split() for p in procs]
    peaks = {name: sum(float(o[o.index(name) + 1]) for o in outs) for name in ("int8", "int4", "fma", "amx_bf16")}
    return {**peaks, "cores": cores}


def linear_macs(model_dir: str, rows: int, sampled: int) -> int:
    """Multiply-adds of `rows` decoder rows and `sampled` lm_head rows of the model at model_dir."""
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    h, inter, layers, vocab = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    nh = c["num_attention_heads"]
    nkv, hd = c.get("num_key_value_heads", nh), c.get("head_dim", h // nh)
    per_row = layers * (h * (nh + 2 * nkv) * hd + nh * hd * h + 3 * h * inter)
    return rows * per_row + sampled * h * vocab


def floor_seconds(model_dir: str, prompt_tokens: int, generated: int, requests: int, peak_gmacs: float) -> float:
    return linear_macs(model_dir, prompt_tokens + generated - requests, generated) / (peak_gmacs * 1e9)


if __name__ == "__main__":
    print(json.dumps(measure_peaks()))


def floor_table(summary: dict, model_dir: str, prompt_tokens: int, requests: int, peaks: dict) -> str:
    """Per mode: its mean seconds over the mix, its floor (its own generated tokens) and the share
    of the floor it reaches; then genpool's best mode against llama.cpp's best."""
    lines = [f"Floor: {peaks.get('cores')} cores, peak {peaks.get('int8', 0):.1f} G int8 multiply-adds/s, "
             f"{peaks.get('int4', 0):.1f} G int4 (integer dot products), {peaks.get('fma', 0):.1f} G fp32 "
             f"(vfmadd231ps) and {peaks.get('amx_bf16', 0):.1f} G bf16 on AMX tiles (tdpbf16ps); "
             f"{prompt_tokens} prompt tokens, {requests} requests", "",
             "| mode | seconds (mean) | generated | linear multiply-adds | floor | share of the floor |",
             "|---|---|---|---|---|---|"]
    for m, s in summary.items():
        seconds = sum(t / r for t, r in zip(s["tokens"], s["tok_s"])) / len(s["tok_s"])
        gen = s["tokens"][0]
        kinds = [k for k in (PEAK_KIND.get(m.split("-")[0]), "amx_bf16" if m.startswith("int8-amx") else None)
                 if k and peaks.get(k)]
        macs = linear_macs(model_dir, prompt_tokens + gen - requests, gen) if kinds else 0
        for kind in kinds:
            floor = macs / (peaks[kind] * 1e9)
            lines.append(f"| {m} | {seconds:.2f} | {gen} | {macs / 1e12:.3f} T | {floor:.2f} s ({kind}) | "
                         f"{floor / seconds:.0%} |")
        if not kinds:
            lines.append(f"| {m} | {seconds:.2f} | {gen} | - | - | - |")
    ours = {m: s["tok_s_mean"] for m, s in summary.items() if not m.startswith("llamacpp")}
    peers = {m: s["tok_s_mean"] for m, s in summary.items() if m.startswith("llamacpp")}
    if ours and peers:
        a, b = max(ours, key=ours.get), max(peers, key=peers.get)
        lines += ["", f"genpool's best ({a}, {ours[a]:.1f} tok/s) is {ours[a] / peers[b]:.2f}x llama.cpp's best "
                      f"({b}, {peers[b]:.1f} tok/s)"]
    return "\n".join(lines)
