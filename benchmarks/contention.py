"""Throughput under a fixed competing load, as a fraction of idle (issue 34, "no collapse under
contention").

For each engine variant: the mix idle, then the same mix while one busy process per core runs at
normal priority (started and stopped here), in rounds that alternate the order. Variants:
  - genpool modes (benchmarks/quant_modes.py, one process per run) under three OpenMP wait
    policies of the libgomp torch ships: its default (`gomp-default`: GOMP_SPINCOUNT 300k spins
    before a thread sleeps), `bounded` (GOMP_SPINCOUNT=10000) and `passive`
    (OMP_WAIT_POLICY=PASSIVE: sleep at once), or spin=N. They govern torch's own ops; the C
    kernels run on their own pool (kernels/cpu/cpu_pool.c). The `genpool` command sets spin=1000
    unless the environment names a policy; each run here sets its variant's;
  - llama.cpp's server (benchmarks/llamacpp_peer.py) when LLAMA_SERVER is set, per --peer-types.

  python benchmarks/contention.py --modes fp32,int8 --num-requests 16 --rounds 2 [--json out.json]
"""
from __future__ import annotations

import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import json  # noqa: E402
import multiprocessing as mp  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
# GOMP_SPINCOUNT=300000 is libgomp's own default for OMP_WAIT_POLICY unset (an "unbounded" spin in
# practice: ~1 ms at a few cycles per spin, longer than a decode step's parallel regions are apart).
BOUNDED_SPINCOUNT = "10000"  # ~30 us of spinning, then a futex sleep
WAIT_VARIANTS = {"bounded": {"GOMP_SPINCOUNT": BOUNDED_SPINCOUNT}, "gomp-default": {"GOMP_SPINCOUNT": "300000"},
                 "passive": {"OMP_WAIT_POLICY": "PASSIVE"}}


def _burn() -> None:  # one busy core's worth of work, normal priority
    x = 0
    while True:
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF


def start_load(n: int) -> list:
    procs = [mp.Process(target=_burn, daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    return procs


def stop_load(procs: list) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        p.join()


def wait_env(wait: str) -> dict:
    """A --waits name as environment: one of WAIT_VARIANTS, or spin=N (GOMP_SPINCOUNT=N)."""
    if wait.startswith("spin="):
        return {"GOMP_SPINCOUNT": str(int(wait[5:]))}
    return WAIT_VARIANTS[wait]


def run_one(variant: str, a, out: str) -> float:
    mode, _, wait = variant.partition("/")
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    env.pop("GOMP_SPINCOUNT", None)
    if mode.startswith("llamacpp"):
        cmd = [sys.executable, os.path.join(HERE, "llamacpp_peer.py"), "--model", a.model,
               "--type", mode.partition("-")[2] or "q4_1"]
    else:
        env.update(wait_env(wait))
        cmd = [sys.executable, os.path.join(HERE, "quant_modes.py"), "--mode", mode, "--model", a.model,
               "--max-num-seqs", str(a.max_num_seqs)]
    cmd += ["--num-requests", str(a.num_requests), "--seed", str(a.seed), "--threads", str(a.threads),
            "--out", out]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    with open(out) as f:
        res = json.load(f)
    return res.get("tok_s") or res["tokens"] / res["seconds"]


def variants(a) -> list[str]:
    out = [f"{m}/{w}" for m in a.modes.split(",") for w in a.waits.split(",")]
    if os.environ.get("LLAMA_SERVER"):
        out += [f"llamacpp-{t}" for t in a.peer_types.split(",")]
    return out


def measure(a) -> dict:
    res = {v: {"idle": [], "loaded": []} for v in variants(a)}
    busy = a.busy if a.busy else os.cpu_count()
    with tempfile.TemporaryDirectory(prefix="genpool-contention-") as tmp:
        for r in range(a.rounds):
            order = list(res) if r % 2 == 0 else list(res)[::-1]
            for v in order:
                res[v]["idle"].append(run_one(v, a, os.path.join(tmp, "r.json")))
                load = start_load(busy)
                try:
                    res[v]["loaded"].append(run_one(v, a, os.path.join(tmp, "r.json")))
                finally:
                    stop_load(load)
                print(f"round {r} {v}: idle {res[v]['idle'][-1]:.1f} tok/s, loaded "
                      f"{res[v]['loaded'][-1]:.1f} tok/s", flush=True)
    for v in res:
        idle, loaded = max(res[v]["idle"]), max(res[v]["loaded"])
        res[v].update(best_idle=idle, best_loaded=loaded, fraction=loaded / idle)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="fp32,int8")
    ap.add_argument("--waits", default="bounded,gomp-default", help=f"of {sorted(WAIT_VARIANTS)}, or spin=N")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peer-types", default="q8_0", help="llama.cpp weights when LLAMA_SERVER is set: "
                    "f32,q8_0,q4_1 (default q8_0)")
    ap.add_argument("--busy", type=int, default=0, help="busy processes (default: one per core)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    print(f"load average before: {os.getloadavg()}", flush=True)
    res = measure(a)
    print("| engine | idle tok/s | loaded tok/s | loaded / idle |\n|---|---|---|---|")
    for v, r in res.items():
        print(f"| {v} | {r['best_idle']:.1f} | {r['best_loaded']:.1f} | {r['fraction']:.0%} |")
    print(f"load average after: {os.getloadavg()}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(results=res, args=vars(a)), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
