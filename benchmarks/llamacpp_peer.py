"""llama.cpp's server as a side-by-side row of `throughput.py --modes ...,llamacpp` (issue 20).

The same 48-request mix (benchmarks/workload.py, the same token ids) goes to `llama-server` on the
same GGUF file genpool's q4_1 mode loads (SmolLM2's shipped Q4_1), with 16 parallel slots and
continuous batching, 2 threads, greedy; requests are sent 16 at a time, as its slots take them.
The row has the keys of a quant_modes run: tok/s, the batch-1 decode step (llama.cpp's own
per-token timing of one 64-token request), generated token ids, and the server's RSS (its whole
process: llama.cpp has no separate KV/library split to subtract).

    python benchmarks/llamacpp_peer.py --server PATH/llama-server [--type f32|q8_0|q4_1] --out row.json
    LLAMA_SERVER=PATH python benchmarks/throughput.py --modes fp32,int8,q4_1,llamacpp-f32,llamacpp-q8_0,llamacpp-q4_1

--type q4_1 (the default; mode `llamacpp` or `llamacpp-q4_1`) serves the shipped GGUF as it is. f32 and
q8_0 are made from it once with llama.cpp's own `llama-quantize --allow-requantize` (beside the server
binary, or $LLAMA_QUANTIZE) into $GENPOOL_HOME/peers: F32 is the Q4_1 weights dequantized, the same
numbers genpool's fp32 checkpoint holds (it is converted from that file), and Q8_0 is quantized
from that F32, so every row runs the same weights.

Build the server from the llama-cpp-python source distribution (it vendors llama.cpp):
    pip download --no-binary :all: --no-deps llama-cpp-python && tar xzf llama_cpp_python-*.tar.gz
    cd llama_cpp_python-*/vendor/llama.cpp && cmake -B build -DCMAKE_BUILD_TYPE=Release \\
      -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \\
      -DLLAMA_BUILD_EXAMPLES=OFF && cmake --build build -j2 --target llama-server llama-quantize
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, last: benchmarks.* and tests.* only, installed packages first


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def _wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if json.load(r).get("status") == "ok":
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError("llama-server did not become healthy")


def _proc_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _completion(port: int, ids: list[int], n: int) -> dict:
    return _post(port, {"prompt": ids, "n_predict": n, "temperature": 0, "top_k": 1, "seed": 0,
                        "cache_prompt": False, "return_tokens": True})


TYPES = {"q4_1": "Q4_1", "q8_0": "Q8_0", "f32": "F32"}  # --type -> llama-quantize's type name


def peer_gguf(server: str, model: str, kind: str) -> str:
    """The GGUF llama.cpp serves for --type kind: the shipped one (q4_1), else one derived from it
    with llama-quantize once and kept under $GENPOOL_HOME/peers."""
    from genpool.engine.models.registry import gguf_path
    from genpool.schemas.config import genpool_home
    shipped = str(gguf_path(model))
    if kind == "q4_1":
        return shipped
    out = genpool_home() / "peers" / f"{model}-{kind}.gguf"
    if not out.exists():
        quantize = os.environ.get("LLAMA_QUANTIZE") or os.path.join(os.path.dirname(server), "llama-quantize")
        if not os.path.exists(quantize):
            raise SystemExit(f"--type {kind} needs llama-quantize beside the server or in $LLAMA_QUANTIZE")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".part")
        subprocess.run([quantize, "--allow-requantize", shipped, str(tmp), TYPES[kind]], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.replace(tmp, out)
    return str(out)


def run(server: str, model: str, num_requests: int, seed: int, threads: int, slots: int,
        kind: str = "q4_1") -> dict:
    from transformers import AutoTokenizer

    from benchmarks.quant_modes import cpu_features
    from benchmarks.workload import build_workload
    from genpool.engine.models.registry import resolve_model
    tok = AutoTokenizer.from_pretrained(str(resolve_model(model)))
    reqs = build_workload(tok, num_requests, seed)
    port = _free_port()
    cmd = [server, "-m", peer_gguf(server, model, kind), "-t", str(threads), "-np", str(slots), "-c",
           str(2048 * slots), "-cb", "--host", "127.0.0.1", "--port", str(port)]
    # llama.cpp's own threading defaults: OMP_WAIT_POLICY=PASSIVE (which genpool's benchmarks may
    # set) puts its OpenMP threads to sleep at every barrier: its batch-1 decode took 30 ms a token
    # with it and 8.3 ms without on this machine
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        _wait_healthy(port, proc)
        res = dict(mode=f"llamacpp-{kind}", cpu_features=cpu_features(), command=" ".join(cmd[:1] + cmd[3:]))
        _completion(port, list(reqs[0].prompt_token_ids[:32]), 4)  # warm-up
        one = _completion(port, list(reqs[0].prompt_token_ids[:64]), 64)
        res["decode_step_batch1_ms"] = one["timings"]["predicted_per_token_ms"]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(slots) as pool:
            outs = list(pool.map(lambda r: _completion(port, list(r.prompt_token_ids), r.max_tokens), reqs))
        res["seconds"] = time.perf_counter() - t0
        res["gens"] = [list(o.get("tokens") or []) for o in outs]
        res["tokens"] = sum(o["tokens_predicted"] for o in outs)
        res["tok_s"] = res["tokens"] / res["seconds"]
        res["decode_step_mix_ms"] = float("nan")  # llama.cpp reports per-request, not per-step
        res["rss_after_run"] = _proc_kb(proc.pid, "VmRSS") * 1024
        res["rss_peak"] = _proc_kb(proc.pid, "VmHWM") * 1024
        res["rss_before_model"], res["kv_bytes"], res["kv_resident_after_run"] = 0, 0, 0
        return res
    finally:
        proc.kill()
        proc.wait()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", default=os.environ.get("LLAMA_SERVER"),
                    help="llama-server binary (default: $LLAMA_SERVER)")
    ap.add_argument("--model", default="smollm2-135m", help="registry model with a GGUF (default smollm2-135m)")
    ap.add_argument("--num-requests", type=int, default=48, help="requests in the mix (default 48)")
    ap.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads (default 2)")
    ap.add_argument("--slots", type=int, default=16, help="parallel slots (default 16)")
    ap.add_argument("--type", choices=sorted(TYPES), default="q4_1", help="weights llama.cpp serves (default q4_1)")
    ap.add_argument("--out", required=True, help="write the row's JSON here")
    a = ap.parse_args(argv)
    if not a.server or not os.path.exists(a.server):
        ap.error("no llama-server binary: pass --server or set LLAMA_SERVER (see this file's docstring)")
    res = run(a.server, a.model, a.num_requests, a.seed, a.threads, a.slots, a.type)
    with open(a.out, "w") as f:
        json.dump(res, f)
    print(f"llama.cpp {a.type}: {res['tokens']} tokens in {res['seconds']:.1f} s = {res['tok_s']:.1f} tok/s; "
          f"batch-1 decode {res['decode_step_batch1_ms']:.1f} ms/token; RSS {res['rss_after_run'] / 1e6:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
