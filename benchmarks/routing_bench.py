"""Prefix-aware routing (issue 21), one run, routing off vs on, side by side.

Workload A (shared prefixes): `--prefixes` distinct documents of ~`--prefix-tokens` tokens, each
asked `--questions` questions, arriving interleaved (doc 0 q0, doc 1 q0, ..., doc 11 q0, doc 0 q1,
...), all submitted at once. Each worker's KV budget (`--kv-blocks`) holds about 4 documents.
Workload B (no shared prefix): `--unique` distinct prompts of ~`--unique-tokens` tokens.

Reported per run: prompt tokens the engines actually computed (prefix-cache queries minus hits,
summed over the pool's engines: a count, so the machine's noise does not move it), the pool's
prefix hit rate, end-to-end seconds (first submit to last result), and how routing placed jobs.

The workers are Worker objects on threads of this one process (one engine each, one torch
thread each): the project's machines allow two model processes at a time, and a pool of three is
the point. Each run gets fresh workers (routing on or off) on the same engines, a fresh key prefix
and documents no earlier run has seen, so no run profits from another's cache.

  python benchmarks/routing_bench.py --model smollm2-135m --json /tmp/routing.json
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(ROOT)  # the repo root, last: benchmarks.* and tests.* only, installed packages first

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402

from genpool.producer import Client  # noqa: E402
from genpool.schemas import Keys  # noqa: E402
from genpool.schemas.connection import connect, delete_prefix  # noqa: E402

WORDS = ("river stone lamp harbor winter signal copper garden market cloud engine paper "
         "forest bridge candle mirror valley orbit meadow lantern glacier ember quarry "
         "canyon falcon island velvet thunder saddle compass cedar marble").split()
QUESTIONS = ["What is the first item?", "Name one place.", "Which metal appears?",
             "Summarize in one word.", "What season is it?", "Is there water?",
             "What animal appears?", "Which light source?", "Count the trees.",
             "What is the last item?", "Who travels?", "What is built?"]


def document(rng: random.Random, n_words: int, tag: str) -> str:
    lines, words = [], [rng.choice(WORDS) for _ in range(n_words)]
    for i in range(0, n_words, 12):
        lines.append(" ".join(words[i:i + 12]) + ".")
    return f"Report {tag}.\n" + "\n".join(lines)


def shared_workload(a, seed: int, tok) -> list[dict]:
    rng = random.Random(seed)
    docs = []
    for k in range(a.prefixes):
        d = document(rng, a.prefix_tokens, f"{seed}-{k}")  # over a token a word: trimmed below
        while len(tok(d)["input_ids"]) > a.prefix_tokens:
            d = d[: int(len(d) * 0.97)]
        docs.append(d)
    return [dict(prompt=f"{docs[k]}\n\nQuestion: {QUESTIONS[q % len(QUESTIONS)]} ({q})\nAnswer:",
                 max_tokens=a.max_tokens, temperature=0.0, job_id=f"s{seed}-d{k}-q{q}")
            for q in range(a.questions) for k in range(a.prefixes)]


def unique_workload(a, seed: int, tok) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(a.unique):
        d = document(rng, a.unique_tokens, f"u{seed}-{i}")
        while len(tok(d)["input_ids"]) > a.unique_tokens:
            d = d[: int(len(d) * 0.97)]
        out.append(dict(prompt=f"{d}\nAnswer:", max_tokens=a.max_tokens, temperature=0.0,
                        job_id=f"u{seed}-{i}"))
    return out


def totals(engines) -> dict:
    st = [e.stats() for e in engines]
    return {"queries": sum(s.prefix_cache_queries for s in st),
            "hits": sum(s.prefix_cache_hits for s in st),
            "per_worker": [s.prefix_cache_queries - s.prefix_cache_hits for s in st]}


def run(a, engines, specs: list[dict], routing: bool, label: str) -> dict:
    from genpool.workers.worker import Worker, WorkerConfig

    prefix = f"bench-route-{uuid.uuid4().hex[:8]}"
    workers, threads = [], []
    for i, eng in enumerate(engines):
        cfg = WorkerConfig(name=f"w{i}", served_models=frozenset({"m"}), prefix_routing=routing,
                           heartbeat_s=1.0, max_inflight=a.max_num_seqs,
                           prefix_index_s=a.index_s)
        w = Worker(eng, connect(a.redis, socket_timeout=30), Keys(prefix), cfg)
        t = threading.Thread(target=w.run, daemon=True)
        workers.append(w)
        threads.append(t)
        t.start()
    c = Client(a.redis, prefix)
    while not all(w.started for w in workers):
        time.sleep(0.05)
    time.sleep(2 * a.index_s)  # every index published once
    before = totals(engines)
    t0 = time.perf_counter()
    jobs = c.submit_many(specs)
    results = [j.result(timeout=3600) for j in jobs]
    dt = time.perf_counter() - t0
    after = totals(engines)
    for w in workers:
        w.stop(drain_timeout_s=5.0)
    for t in threads:
        t.join(60)
    ran_on = {}
    for j in jobs:
        ran_on[j.id] = c.job(j.id).info().get("worker")
    routed = {k: sum(w.router.counts[k] for w in workers)
              for k in ("routed_affinity", "routed_load", "routed_fallback", "handed_off")}
    _drop(a.redis, prefix)
    c.close()
    q, h = after["queries"] - before["queries"], after["hits"] - before["hits"]
    errors = [r.error for r in results if r.error is not None]
    out = {"label": label, "routing": routing, "jobs": len(jobs), "errors": len(errors),
           "computed_prompt_tokens": q - h, "prompt_tokens_queried": q,
           "pool_hit_rate": round(h / q, 4) if q else None, "seconds": round(dt, 2),
           "prompt_tokens_per_job": round(q / len(jobs), 1),
           "computed_per_worker": [x - y for x, y in zip(after["per_worker"],
                                                         before["per_worker"])],
           "jobs_per_worker": {w.name: sum(v == w.name for v in ran_on.values()) for w in workers},
           **routed, "texts": {j.id: r.text for j, r in zip(jobs, results)}}
    print(f"{label:<28} routing={'on ' if routing else 'off'} computed={q - h:>7} "
          f"hit={out['pool_hit_rate']} e2e={dt:7.1f}s tokens/job={q / len(jobs):.0f} jobs/worker={out['jobs_per_worker']} "
          f"routed={routed} errors={len(errors)}", flush=True)
    return out


def _drop(url: str, prefix: str) -> None:
    r = connect(url)
    delete_prefix(r, prefix)
    r.close()


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--redis", default=os.environ.get("GENPOOL_REDIS_URL", "redis://127.0.0.1:6379/9"))
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--prefixes", type=int, default=12)
    p.add_argument("--questions", type=int, default=10)
    p.add_argument("--prefix-tokens", type=int, default=800)
    p.add_argument("--unique", type=int, default=36)
    p.add_argument("--unique-tokens", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--kv-blocks", type=int, default=224, help="per worker (16 tokens each)")
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--index-s", type=float, default=0.5)
    p.add_argument("--skip-unique", action="store_true")
    p.add_argument("--json")
    return p.parse_args()


def main() -> int:
    a = parse_args()
    from genpool.engine import LLM, SamplingParams

    t_load = time.perf_counter()
    llms = [LLM(a.model, dtype=a.dtype, num_kv_blocks=a.kv_blocks, max_num_seqs=a.max_num_seqs,
                max_num_batched_tokens=1024, num_threads=1) for _ in range(a.workers)]
    for llm in llms:  # warm-up
        llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=2))
    engines = [llm.llm_engine for llm in llms]
    tok = engines[0].tokenizer
    print(f"{a.workers} engines loaded in {time.perf_counter() - t_load:.1f} s; "
          f"{a.kv_blocks} KV blocks each ({a.kv_blocks * 16} tokens)", flush=True)
    res = []
    res.append(run(a, engines, shared_workload(a, 1, tok), False, "shared prefixes"))
    res.append(run(a, engines, shared_workload(a, 2, tok), True, "shared prefixes"))
    if not a.skip_unique:
        res.append(run(a, engines, unique_workload(a, 3, tok), False, "no shared prefix"))
        res.append(run(a, engines, unique_workload(a, 4, tok), True, "no shared prefix"))
    off, on = res[0], res[1]
    print(f"shared prefixes: {off['computed_prompt_tokens'] / max(1, on['computed_prompt_tokens']):.2f}x "
          f"fewer computed prompt tokens, {off['seconds'] / on['seconds']:.2f}x faster end to end")
    if len(res) == 4:
        print(f"no shared prefix: on/off time {res[3]['seconds'] / res[2]['seconds']:.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "runs": res, "loadavg": os.getloadavg(),
                       "cpus": os.cpu_count()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
