"""Resume vs restart, side by side in one run (issue 30).

The workload: N jobs of T tokens (ignore_eos) on 2 worker processes; when half of all tokens are
published, one worker is SIGKILLed (not replaced); the other finishes everything. Run once with
resume (the default) and once with `--no-resume` (the earlier behaviour: a taken-over job reruns
from the start). Measured from the jobs' own event logs, which hold every published token of
every attempt with its time (the entry id):
  - tokens published pool-wide, and wasted = published - the results' tokens; tokens the victim
    decoded in its last step but never published are not seen (at most 2 steps per job in flight:
    the publisher holds one batch);
  - end-to-end time, first submit to last result;
  - the longest pause a reader saw: the longest time, within a job, between two moments its
    shown text grew (a restart's re-sent text is not growth: the client swallows it).
Target: tokens wasted by the kill with resume <= 5% of what restart wastes.

  python benchmarks/resume_bench.py --jobs 200 --tokens 400 --json out.json   # fake engine
  python benchmarks/resume_bench.py --model smollm2-135m --jobs 16 --tokens 200  # the real model
The fake engine (tests/fake_engine.py, one token per job per step, --step-delay seconds a step)
measures the queue; the real model adds what a resume's prefill costs.
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(ROOT)  # the repo root, last: benchmarks.* and tests.* only

import argparse  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402

from genpool.producer import Client  # noqa: E402
from genpool.schemas import parse_event  # noqa: E402
from tests.pool_helpers import (  # noqa: E402
    drop_prefix,
    new_prefix,
    spawn_worker,
    stop_proc,
    tests_only_path,
    wait_for,
    workers_alive,
)


def published(c: Client, jobs) -> int:
    pipe = c.redis.pipeline(transaction=False)
    for j in jobs:
        pipe.xlen(c.keys.events(j.id))
    return sum(pipe.execute())  # one token per entry here (one step's token per job)


def job_log(c: Client, job_id: str) -> list[tuple[float, object]]:
    return [(int(i.split("-")[0]) / 1000, parse_event(f["event"]))
            for i, f in c.redis.xrange(c.keys.events(job_id))]


def reader_pause(log) -> float:
    """Longest time between two growths of what a reader was shown (restart: the rerun's text
    shows only once it passes what was shown before)."""
    shown, count, last, worst = 0, 0, None, 0.0
    for t, e in log:
        if e.type == "restart":
            count = 0
        elif e.type == "resume":
            count = sum(e.tokens)
        elif e.type == "token":
            count += len(e.token_ids)
            if count > shown:
                if last is not None:
                    worst = max(worst, t - last)
                shown, last = count, t
    return worst


def run(a, mode: str) -> dict:
    prefix = new_prefix(f"resume-{mode}")
    c = Client(a.redis, prefix)
    extra = ["--max-num-seqs", str(a.max_num_seqs), "--claim-idle-ms", str(a.claim_idle_ms),
             "--heartbeat-s", "0.5", *([] if mode == "resume" else ["--no-resume"])]
    env = {}
    if a.model:
        model, extra = a.model, extra + ["--num-threads", "1"]
    else:
        model, extra = "fake", extra + ["--engine-factory", "tests.fake_engine:make"]
        env["GENPOOL_FAKE_STEP_DELAY"] = str(a.step_delay)
        # the child imports tests.fake_engine (never the checkout root: -P keeps it off)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [tests_only_path(),
                                                          os.environ.get("PYTHONPATH")]))
    procs = [spawn_worker(a.redis, prefix, model, f"{mode}-{k}", *extra, env=env)
             for k in range(2)]
    try:
        wait_for(lambda: workers_alive(a.redis, prefix) == 2, timeout=600, what="2 workers")
        t0 = time.time()
        jobs = c.submit_many([dict(prompt=f"job {i}: a long story", max_tokens=a.tokens,
                                   ignore_eos=True, temperature=0.0) for i in range(a.jobs)])
        total = a.jobs * a.tokens
        wait_for(lambda: published(c, jobs) >= total // 2, timeout=3600, interval=0.05,
                 what="half the tokens")
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].wait()
        t_kill = time.time()
        results = [j.result(timeout=3600) for j in jobs]
        t_end = time.time()
    finally:
        for p in procs:
            stop_proc(p, 30)
    logs = {j.id: job_log(c, j.id) for j in jobs}
    pub = sum(len(e.token_ids) for log in logs.values() for _, e in log if e.type == "token")
    useful = sum(len(r.token_ids) for r in results)
    row = {"mode": mode, "jobs": a.jobs, "tokens_per_job": a.tokens,
           "ok": sum(r.error is None and len(r.token_ids) == a.tokens for r in results),
           "published_tokens": pub, "wasted_tokens": pub - useful,
           "taken_over": sum(int(c.job(j.id).info().get("attempts", 1)) > 1 for j in jobs),
           "e2e_s": round(t_end - t0, 2), "after_kill_s": round(t_end - t_kill, 2),
           "longest_pause_s": round(max(reader_pause(log) for log in logs.values()), 2)}
    c.close()
    drop_prefix(a.redis, prefix)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--redis", default=os.environ.get("GENPOOL_REDIS_URL",
                                                     "redis://127.0.0.1:6379/9"))
    p.add_argument("--model", default="", help="a model for real workers (default: fake engine)")
    p.add_argument("--jobs", type=int, default=200)
    p.add_argument("--tokens", type=int, default=400)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--claim-idle-ms", type=int, default=3000)
    p.add_argument("--step-delay", type=float, default=0.02)
    p.add_argument("--json", default="")
    a = p.parse_args()
    rows = [run(a, "resume"), run(a, "restart")]
    res, rst = rows
    ratio = res["wasted_tokens"] / max(1, rst["wasted_tokens"])
    out = {"rows": rows, "wasted_ratio": round(ratio, 4), "target_met": ratio <= 0.05}
    print("| mode | ok | taken over | published | wasted | e2e s | after kill s | longest pause s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['ok']}/{r['jobs']} | {r['taken_over']} | "
              f"{r['published_tokens']} | {r['wasted_tokens']} | {r['e2e_s']} | "
              f"{r['after_kill_s']} | {r['longest_pause_s']} |")
    print(f"wasted with resume / wasted with restart = {ratio:.4f} (target <= 0.05: "
          f"{'met' if out['target_met'] else 'NOT met'})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
