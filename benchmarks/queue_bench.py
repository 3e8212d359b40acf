"""Queue benchmark, one run, two figures:

1. Throughput: the same greedy chat workload (benchmarks/workload.py) through
   (a) the in-process engine, `LLM.generate` with every request at once, and
   (b) Redis: `submit_many` -> a `genpool worker` subprocess with the same engine options -> results,
   timed from the first submit to the last result read. Target: (b) >= 95% of (a).
2. Priority: a 500-job bulk backlog (low lane) fills the worker; then one interactive job (high
   lane) arrives. Its time to first token, in seconds and in engine steps. Target: <= 3 steps.

  python benchmarks/queue_bench.py --model smollm2-135m --num-jobs 48 --json out.json
Redis: --redis / GENPOOL_REDIS_URL, else a private redis-server started for the run.
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(ROOT)  # the repo root, last: benchmarks.* and tests.* only, installed packages first

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402

from benchmarks.workload import build_workload, workload_stats  # noqa: E402
from genpool.producer import Client  # noqa: E402
from genpool.schemas.connection import delete_prefix  # noqa: E402


def engine_opts(a) -> dict:
    return {"max_num_seqs": a.max_num_seqs, "max_num_batched_tokens": a.max_num_batched_tokens,
            "dtype": a.dtype}


def load_in_process(a, model, work):
    from genpool.engine import LLM, SamplingParams

    llm = LLM(str(model), **engine_opts(a))
    llm.generate([{"prompt_token_ids": work[0].prompt_token_ids}],
                 SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    return llm


def run_in_process(llm, work) -> dict:
    from genpool.engine import SamplingParams

    prompts = [{"prompt_token_ids": w.prompt_token_ids} for w in work]
    params = [SamplingParams(temperature=0.0, max_tokens=w.max_tokens) for w in work]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": dt, "completion_tokens": toks, "tok_per_s": toks / dt,
            "texts": [o.outputs[0].text for o in outs]}


def start_worker(a, model, url: str, prefix: str, log_path: str) -> subprocess.Popen:
    cmd = [sys.executable, "-P", "-m", "genpool.workers.cli.main", "worker", "--model", str(model), "--redis", url,
           "--prefix", prefix, "--name", "bench", "--max-num-seqs", str(a.max_num_seqs),
           "--max-num-batched-tokens", str(a.max_num_batched_tokens), "--dtype", a.dtype,
           "--heartbeat-s", "0.5", "--drain-timeout", "0", "--log-level", "WARNING"]
    # no PYTHONPATH=ROOT: the checkout root's folders (kernels/, ...) would shadow installed
    # packages in the child (Hugging Face's kernels, which transformers imports); -P keeps cwd off
    return subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ), stdout=subprocess.DEVNULL,
                            stderr=open(log_path, "wb"))


def wait_worker(client: Client, proc, log_path: str) -> dict:
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"worker died; log {log_path}:\n" + open(log_path).read()[-3000:])
        alive = [w for w in client.status()["workers"] if w["alive"]]
        if alive:
            return alive[0]
        time.sleep(0.2)


def run_through_redis(client: Client, work) -> dict:
    specs = [{"messages": w.messages, "max_tokens": w.max_tokens, "temperature": 0.0}
             for w in work]
    t0 = time.perf_counter()
    jobs = client.submit_many(specs)
    results = [j.result(timeout=3600, raise_on_error=False) for j in jobs]
    dt = time.perf_counter() - t0
    bad = [r.error for r in results if r.error]
    if bad:
        raise SystemExit(f"{len(bad)} jobs failed, first: {bad[0]}")
    toks = sum(r.usage.completion_tokens for r in results)
    return {"seconds": dt, "completion_tokens": toks, "tok_per_s": toks / dt,
            "texts": [r.text for r in results]}


def worker_info(client: Client) -> dict:
    return next(w for w in client.status()["workers"] if w["name"] == "bench")


def step_period(client: Client, window_s: float) -> float:
    """Seconds per engine step, from the worker's step counter in its heartbeats."""
    a = worker_info(client)
    time.sleep(window_s)
    b = worker_info(client)
    return (b["beat"] - a["beat"]) / max(1, b["steps"] - a["steps"])


def run_priority(a, client: Client, work) -> dict:
    bulk = [{"messages": work[i % len(work)].messages, "max_tokens": a.backlog_max_tokens,
             "temperature": 0.0, "ignore_eos": True, "priority": 1} for i in range(a.backlog)]
    client.submit_many(bulk)
    while worker_info(client)["running"] < a.max_num_seqs:  # the engine is full of bulk work
        time.sleep(0.1)
    period = step_period(client, a.period_window)
    vip = client.submit(messages=[{"role": "user", "content": "Say hello."}], max_tokens=8,
                        temperature=0.0, priority=-1)
    res = vip.result(timeout=600)
    depth = client.status()["lanes"]["low"]
    t = res.timings
    return {"backlog": a.backlog, "queued_low_after": depth["queued"],
            "running_when_submitted": a.max_num_seqs, "step_period_s": period,
            "ttft_s": t.ttft_s, "queued_s": t.queued_s,
            # counted by the worker: engine steps that ended between the job's arrival (its
            # stream entry time) and its first token, that step included
            "ttft_steps": t.ttft_steps, "text": res.text}


def compare(a, llm, client: Client, works: list) -> dict:
    """Alternate the two runs (this machine is shared and noisy), each repeat on a fresh
    workload (so neither side profits from the other's prefix cache), and report the median of
    the per-repeat ratios plus the best of each side."""
    rows = []
    for i, work in enumerate(works):
        local = run_in_process(llm, work)
        b0 = worker_info(client)
        remote = run_through_redis(client, work)
        time.sleep(1.0)  # one more heartbeat carries the worker's loop timings
        b1 = worker_info(client)
        busy, eng = b1["busy_s"] - b0["busy_s"], b1["engine_s"] - b0["engine_s"]
        same = sum(x == y for x, y in zip(local["texts"], remote["texts"]))
        rows.append({"in_process_tok_s": local["tok_per_s"], "redis_tok_s": remote["tok_per_s"],
                     "ratio": remote["tok_per_s"] / local["tok_per_s"],
                     "tokens": remote["completion_tokens"], "identical": same,
                     "worker_busy_s": busy, "worker_engine_s": eng,
                     "overhead": 1 - eng / busy if busy else 0.0})
        r = rows[-1]
        print(f"[{i + 1}/{len(works)}] in-process {r['in_process_tok_s']:.1f} tok/s, through "
              f"Redis {r['redis_tok_s']:.1f} tok/s -> {100 * r['ratio']:.1f}%; {same}/{len(work)}"
              f" texts identical; worker loop {busy:.2f} s busy, {eng:.2f} s in engine.step()"
              f" (queue overhead {100 * r['overhead']:.1f}%)", flush=True)
    best_local = max(r["in_process_tok_s"] for r in rows)
    out = {"rows": rows, "median_ratio": statistics.median(r["ratio"] for r in rows),
           "best_ratio": max(r["redis_tok_s"] for r in rows) / best_local,
           "median_overhead": statistics.median(r["overhead"] for r in rows)}
    print(f"THROUGHPUT through Redis vs in-process: median {100 * out['median_ratio']:.1f}%, "
          f"best-vs-best {100 * out['best_ratio']:.1f}% (target >= 95%); worker time outside "
          f"engine.step() {100 * out['median_overhead']:.1f}% (median)", flush=True)
    return out


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-jobs", type=int, default=48)
    ap.add_argument("--min-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=400)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--backlog", type=int, default=500)
    ap.add_argument("--backlog-max-tokens", type=int, default=64)
    ap.add_argument("--period-window", type=float, default=3.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--redis", default=os.environ.get("GENPOOL_REDIS_URL"))
    ap.add_argument("--json", default=None)
    return ap.parse_args()


def report_priority(a, prio: dict) -> None:
    print(f"PRIORITY: interactive job behind a {a.backlog}-job backlog ({prio['queued_low_after']}"
          f" still queued after it): first token {prio['ttft_steps']} engine steps after its "
          f"arrival (target <= 3), {prio['ttft_s']:.3f} s; mean step "
          f"{prio['step_period_s'] * 1000:.0f} ms", flush=True)


def main() -> int:
    a = parse_args()
    from transformers import AutoTokenizer

    from genpool.engine.models.registry import resolve_model

    model = resolve_model(a.model)
    tok = AutoTokenizer.from_pretrained(str(model))
    works = [build_workload(tok, a.num_jobs, seed=r, max_prompt=a.max_prompt,
                            min_tokens=a.min_tokens, max_tokens=a.max_tokens)
             for r in range(a.repeats)]
    work = works[0]
    print("workload:", json.dumps(workload_stats(work)), flush=True)
    server = None
    if not a.redis:
        from genpool.workers.integrations.embedded import start_server

        server = start_server()
    client = Client(a.redis or server.url, f"bench-{uuid.uuid4().hex[:8]}")
    log_path = os.path.join(ROOT, "out", "bench-worker.log")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    proc = start_worker(a, model, client.url, client.keys.prefix, log_path)
    try:
        llm = load_in_process(a, model, work)
        wait_worker(client, proc, log_path)
        client.submit(messages=work[0].messages, max_tokens=4, temperature=0.0).result(600)
        cmp = compare(a, llm, client, works)
        del llm
        prio = run_priority(a, client, work)
        report_priority(a, prio)
    finally:
        proc.terminate()
        proc.wait(60)
        _drop(client)
        if server is not None:
            server.stop()
    if a.json:
        out = {"workload": workload_stats(work), "args": vars(a), "throughput": cmp,
               "priority": prio}
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def _drop(client: Client) -> None:
    delete_prefix(client.redis, client.keys.prefix)


if __name__ == "__main__":
    sys.exit(main())
