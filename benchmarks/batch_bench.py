"""The server-side Batch API (issue 32) against today's client-side `genpool batch`, one run each,
on the same pool: N documents x M questions as one OpenAI batch file.

- `genpool batch` (producer/batch.py BatchRun, its default 64 lines in flight, in file order);
- the gateway's Batch API (a `genpool gateway` process: upload, create, poll until done), whose
  driver feeds the lines a window at a time, each document's first question first.

The file interleaves documents (doc 0 q0, doc 1 q0, ..., doc 0 q1, ...), as a pipeline that
writes one line per (document, question) would. Reported per run: prompt tokens the engines
computed (prefix-cache queries minus hits over the pool: a count, not moved by the machine's
noise), the pool's prefix hit rate, end-to-end seconds, and the first-token time of interactive
requests sent while the batch runs. The floor of computed tokens is each document once.

Workers are Worker objects on threads of this process (one engine each, one torch thread each),
with prefix routing on; each run gets fresh workers on the same engines, a fresh key prefix and
documents no earlier run has seen.

  python benchmarks/batch_bench.py --json /tmp/batch_bench.json
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(ROOT)  # the repo root, last: benchmarks.* and tests.* only

import argparse  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402

from benchmarks.routing_bench import shared_workload, totals  # noqa: E402
from genpool.producer import Client  # noqa: E402
from genpool.schemas import Keys  # noqa: E402
from genpool.schemas.connection import connect, delete_prefix  # noqa: E402


def batch_lines(specs: list[dict]) -> bytes:
    return "".join(json.dumps({"custom_id": s["job_id"], "method": "POST",
                               "url": "/v1/completions",
                               "body": {"model": "m", "prompt": s["prompt"],
                                        "max_tokens": s["max_tokens"], "temperature": 0.0}})
                   + "\n" for s in specs).encode()


class Probe(threading.Thread):
    """Interactive requests (priority -1) every `every_s` while the batch runs: first-token s."""

    def __init__(self, url: str, prefix: str, every_s: float = 2.0):
        super().__init__(daemon=True)
        self.c, self.every_s, self.ttft, self.done = Client(url, prefix), every_s, [], False

    def run(self) -> None:
        while not self.done:
            t0 = time.perf_counter()
            job = self.c.submit("Hello, how are you?", model="m", max_tokens=4, priority=-1,
                                temperature=0.0)
            next(iter(job.stream(timeout=600)), None)
            self.ttft.append(time.perf_counter() - t0)
            job.result(timeout=600)
            time.sleep(self.every_s)


def start_workers(a, engines, prefix: str):
    from genpool.workers.worker import Worker, WorkerConfig

    workers, threads = [], []
    for i, eng in enumerate(engines):
        cfg = WorkerConfig(name=f"w{i}", served_models=frozenset({"m"}), prefix_routing=True,
                           heartbeat_s=1.0, max_inflight=a.max_num_seqs, prefix_index_s=1.0)
        w = Worker(eng, connect(a.redis, socket_timeout=30), Keys(prefix), cfg)
        threads.append(threading.Thread(target=w.run, daemon=True))
        threads[-1].start()
        workers.append(w)
    while not all(w.started for w in workers):
        time.sleep(0.05)
    time.sleep(2.0)  # every index published once
    return workers, threads


def via_cli(a, prefix: str, data: bytes, _gw) -> None:
    from genpool.producer.batch import run_batch

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "in.jsonl").write_bytes(data)
        run_batch(Path(d) / "in.jsonl", Path(d) / "out.jsonl", client=Client(a.redis, prefix),
                  progress=False)


def via_gateway(a, prefix: str, data: bytes, gw_url: str) -> None:
    import openai

    c = openai.OpenAI(base_url=f"{gw_url}/v1", api_key="x", max_retries=3)
    f = c.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    while (b := c.batches.retrieve(b.id)).status not in ("completed", "failed", "expired",
                                                         "cancelled"):
        time.sleep(0.5)
    assert b.status == "completed" and b.request_counts.failed == 0, b


def gateway(a, prefix: str):
    from tests.pool_helpers import free_port, http_ok

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-P", "-m", "genpool.workers.cli.main", "gateway",
                             "--port", str(port), "--redis", a.redis, "--prefix", prefix,
                             "--log-level", "warning", "--max-file-bytes", str(256 << 20)],
                            cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    while not http_ok(f"{url}/health"):
        assert proc.poll() is None, "the gateway did not start"
        time.sleep(0.2)
    return proc, url


def run(a, engines, specs, how, label: str) -> dict:
    prefix = f"bench-batch-{uuid.uuid4().hex[:8]}"
    workers, threads = start_workers(a, engines, prefix)
    proc, url = gateway(a, prefix) if how is via_gateway else (None, None)
    probe = Probe(a.redis, prefix)
    before, t0 = totals(engines), time.perf_counter()
    probe.start()
    how(a, prefix, batch_lines(specs), url)
    dt = time.perf_counter() - t0
    probe.done = True
    probe.join(600)
    after = totals(engines)
    for w in workers:
        w.stop(drain_timeout_s=5.0)
    for t in threads:  # ended before the keys go: a running worker would make its lanes again
        t.join(60)
    if proc is not None:
        proc.terminate()
        proc.wait(30)
    r = connect(a.redis)
    delete_prefix(r, prefix)
    r.close()
    q, h = after["queries"] - before["queries"], after["hits"] - before["hits"]
    out = {"label": label, "lines": len(specs), "computed_prompt_tokens": q - h,
           "prompt_tokens_queried": q, "pool_hit_rate": round(h / q, 4) if q else None,
           "seconds": round(dt, 1), "interactive_ttft_s": [round(x, 3) for x in probe.ttft],
           "interactive_ttft_median_s": round(statistics.median(probe.ttft), 3)
           if probe.ttft else None}
    print(f"{label:<24} computed={q - h:>7} hit={out['pool_hit_rate']} e2e={dt:7.1f}s "
          f"interactive ttft median={out['interactive_ttft_median_s']}s "
          f"(n={len(probe.ttft)})", flush=True)
    return out


def floor_tokens(specs: list[dict], tok, docs: int) -> int:
    """Prompt tokens computed if each document were computed once: every line's prompt, less
    the cached full 16-token blocks of its document for all but the document's first line."""
    total, seen = 0, set()
    for s in specs:
        doc = s["prompt"].split("\n\nQuestion:")[0]
        n, cached = len(tok(s["prompt"])["input_ids"]), len(tok(doc)["input_ids"]) // 16 * 16
        total += n if doc not in seen else n - cached
        seen.add(doc)
    assert len(seen) == docs
    return total


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--redis", default=os.environ.get("GENPOOL_REDIS_URL", "redis://127.0.0.1:6379/9"))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--prefixes", type=int, default=50)
    p.add_argument("--questions", type=int, default=10)
    p.add_argument("--prefix-tokens", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--kv-blocks", type=int, default=224, help="per worker (16 tokens each)")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json")
    return p.parse_args()


def main() -> int:
    a = parse_args()
    from genpool.engine import LLM, SamplingParams

    llms = [LLM(a.model, dtype=a.dtype, num_kv_blocks=a.kv_blocks, max_num_seqs=a.max_num_seqs,
                max_num_batched_tokens=1024, num_threads=1) for _ in range(a.workers)]
    for llm in llms:
        llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=2))
    engines = [llm.llm_engine for llm in llms]
    tok = engines[0].tokenizer
    work = [shared_workload(a, 11, tok), shared_workload(a, 12, tok)]
    floor = floor_tokens(work[1], tok, a.prefixes)
    res = [run(a, engines, work[0], via_cli, "genpool batch (client)"),
           run(a, engines, work[1], via_gateway, "Batch API (gateway)")]
    print(f"floor (each document once) {floor} tokens; client "
          f"{res[0]['computed_prompt_tokens'] / floor:.2f}x, gateway "
          f"{res[1]['computed_prompt_tokens'] / floor:.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "runs": res, "floor_tokens": floor,
                       "loadavg": os.getloadavg(), "cpus": os.cpu_count()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
