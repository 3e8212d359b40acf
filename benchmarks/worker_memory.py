"""Resident memory of one `genpool worker` (defaults) at start and after large / hostile input.

Starts the worker in a child process on a throwaway prefix, reads its VmRSS / VmHWM from /proc
when it is ready, then sends a hostile mix (1M-character prompts, prompts over the context,
junk entries, wrong types) and large valid work (16 concurrent ~3000-token prompts, one ~7500-token
prompt), and reads them again: right after, and after the worker has been idle for a few seconds.
Prints one JSON object; the worker's own start-phase log lines go to --log.
`--workload mix` sends the throughput benchmark's 48-request chat mix (benchmarks/workload.py, greedy)
instead: the worker's RSS per weight mode at start and after that mix (issue 34).

    python benchmarks/worker_memory.py [--model smollm2-135m] [--log /tmp/worker.log] [-- worker args]
    python benchmarks/worker_memory.py --workload mix -- --quantization int8
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))

from genpool.producer import Client  # noqa: E402
from genpool.schemas.connection import delete_prefix  # noqa: E402


def mem(pid: int) -> dict:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = round(int(line.split()[1]) / 1024)
    return {"rss_mib": out.get("VmRSS"), "peak_mib": out.get("VmHWM")}


def hostile(c: Client) -> list:
    jobs = []
    lane = c.keys.jobs("normal")
    for i in range(4):
        c.redis.xadd(lane, {"job": json.dumps({"id": f"h{i}-{uuid.uuid4().hex[:6]}",
                                               "prompt": "z" * 1_000_001, "max_tokens": 4})})
        c.redis.xadd(lane, {"junk": os.urandom(64)})
        c.redis.xadd(lane, {"job": json.dumps({"id": f"w{i}-{uuid.uuid4().hex[:6]}",
                                               "prompt": [1, 2], "max_tokens": "ten"})})
    over = " ".join(["harbor lamp"] * 5000)  # ~10000 tokens: over the 8192 context
    jobs += [c.submit(over, max_tokens=4) for _ in range(4)]
    big = " ".join(["the keeper wound the clockwork and trimmed the wick"] * 300)  # ~3000 tokens
    jobs += [c.submit(big + f" {i}", max_tokens=32, temperature=0.0) for i in range(16)]
    longest = " ".join(["the light flashed twice every fifteen seconds"] * 900)  # ~7500 tokens
    jobs.append(c.submit(longest, max_tokens=16, temperature=0.0))
    return jobs


def mix(c: Client, model: str) -> list:
    from transformers import AutoTokenizer

    from benchmarks.workload import build_workload
    from genpool.engine.models.registry import resolve_model
    reqs = build_workload(AutoTokenizer.from_pretrained(str(resolve_model(model))), 48, 0)
    return [c.submit(prompt_token_ids=list(r.prompt_token_ids), max_tokens=r.max_tokens, temperature=0.0)
            for r in reqs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--redis", default=None)
    ap.add_argument("--log", default="/tmp/genpool-worker-memory.log")
    ap.add_argument("--workload", choices=["hostile", "mix"], default="hostile")
    ap.add_argument("worker_args", nargs="*")
    a = ap.parse_args()
    prefix = f"mem-{uuid.uuid4().hex[:8]}"
    c = Client(a.redis, prefix)
    cmd = [sys.executable, "-P", "-m", "genpool.workers.cli.main", "worker", "--model", a.model, "--redis", c.url,
           "--prefix", prefix, *a.worker_args]
    t0 = time.monotonic()
    # no PYTHONPATH=ROOT: the checkout's top-level folders (kernels/ among them) would shadow
    # site-packages (Hugging Face's `kernels`, which transformers imports); genpool is installed
    proc = subprocess.Popen(cmd, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=open(a.log, "wb"))
    report: dict = {"model": a.model, "worker_args": a.worker_args, "workload": a.workload}
    try:
        while not c.job("x").serving_workers():
            if proc.poll() is not None:
                raise SystemExit(f"worker exited; see {a.log}")
            time.sleep(0.5)
        report["start_s"] = round(time.monotonic() - t0, 1)
        report["at_start"] = mem(proc.pid)
        jobs = hostile(c) if a.workload == "hostile" else mix(c, a.model)
        results = [j.result(timeout=1800, raise_on_error=False) for j in jobs]
        report["jobs"] = {"ok": sum(r.ok for r in results),
                          "failed": sorted({r.error.code for r in results if not r.ok})}
        report[f"after_{a.workload}"] = mem(proc.pid)
        time.sleep(5)  # idle: the engine returns its large step buffers
        report["after_idle"] = mem(proc.pid)
        report["alive"] = proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(60)
        delete_prefix(c.redis, prefix)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
