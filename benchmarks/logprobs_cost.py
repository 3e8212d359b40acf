"""Throughput cost of `logprobs=5` (issue 33's target: <= 5%) on the held-out mix, engine level.

The benchmarks/workload.py mix (48 chat requests, seed 0, greedy) through one `LLM` on
SmolLM2-135M fp32, with `SamplingParams(logprobs=5)` and without, alternated on the same engine
(none, lp5, lp5, none, ...: load from other processes falls on both alike). Greedy decoding: both
modes must produce the same token ids (logprobs are read off the raw distribution, they change
nothing). `lp5_copy` is lp5 with the sampler as it was before this benchmark (the asking rows'
logits copied with index_select before the log-softmax). Also the sampler alone: one call on
[rows, 49152] greedy logits per mode. Wall time and this process's CPU time (all threads) are
both recorded, and the share of each run's wall time spent inside Sampler._logprobs (the only
code that runs for logprobs alone): on a shared machine the share is the steadiest of the three,
since other processes slow both of its parts at once. This is the engine's share; a worker also decodes each top id for `token_texts` and writes the
maps into the event stream (not measured here).

  python benchmarks/logprobs_cost.py --repeats 2 --json out.json
"""
from __future__ import annotations

import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from contextlib import contextmanager, nullcontext  # noqa: E402

import torch  # noqa: E402

from benchmarks.workload import build_workload  # noqa: E402

MODES = {"none": None, "lp5": 5, "lp5_copy": 5}


class Timed:
    """Seconds spent inside Sampler._logprobs while active: its share of the same run's time is
    steadier on a shared machine than two runs' ratio (the load falls on both parts alike)."""

    def __init__(self):
        self.s = 0.0

    @contextmanager
    def active(self):
        from genpool.engine.sampler import Sampler

        inner = Sampler._logprobs

        def timed(logits, rows, tokens):
            t0 = time.perf_counter()
            try:
                return inner(logits, rows, tokens)
            finally:
                self.s += time.perf_counter() - t0
        Sampler._logprobs = staticmethod(timed)
        try:
            yield
        finally:
            Sampler._logprobs = staticmethod(inner)


@contextmanager
def copying_logprobs():
    """The sampler before: every asking row's logits copied first (here all rows ask)."""
    from genpool.engine.sampler import Sampler

    now = Sampler._logprobs

    def before(logits, rows, tokens):
        return now(logits.index_select(0, torch.arange(logits.shape[0])), rows, tokens)
    Sampler._logprobs = staticmethod(before)
    try:
        yield
    finally:
        Sampler._logprobs = staticmethod(now)


def sampler_alone(rows: int, calls: int, logprobs) -> float:
    """Seconds per sampler call on [rows, 49152] logits, every row greedy."""
    from genpool.engine.sampler import Sampler, SampleRow
    from genpool.engine.sampling_params import SamplingParams

    logits = torch.randn(rows, 49152, generator=torch.Generator().manual_seed(0)) * 4
    params = SamplingParams(temperature=0, logprobs=logprobs)
    s = Sampler()
    batch = [SampleRow(params, [1, 2], [3] * 10) for _ in range(rows)]
    s(logits, batch)
    t0 = time.perf_counter()
    for _ in range(calls):
        s(logits, batch)
    return (time.perf_counter() - t0) / calls


def engine_run(llm, reqs, logprobs, max_tokens) -> tuple[float, float, int, list]:
    from genpool.engine import SamplingParams

    prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in reqs]
    params = [SamplingParams(temperature=0, logprobs=logprobs,
                             max_tokens=min(r.max_tokens, max_tokens or r.max_tokens))
              for r in reqs]
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    ids = [list(o.outputs[0].token_ids) for o in outs]
    if logprobs is not None:  # one map per token, each with the top ids and the chosen one
        for o in outs:
            lp = o.outputs[0].logprobs
            assert len(lp) == len(o.outputs[0].token_ids) and all(len(d) >= 5 for d in lp)
    return dt, cpu, sum(map(len, ids)), ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=None, help="cap each request's max_tokens")
    ap.add_argument("--repeats", type=int, default=2, help="runs per mode, order alternated")
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from genpool.engine import LLM

    res: dict = {"load_avg_start": os.getloadavg(), "tok_s": {m: [] for m in MODES},
                 "cpu_s": {m: [] for m in MODES}, "sampler_ms": {m: [] for m in MODES},
                 "share": {m: [] for m in MODES}}
    # no prefix caching: every run prefills the whole mix (with it, runs after the first
    # found their prompts cached and were mostly decode)
    llm = LLM(args.model, dtype="float32", max_num_seqs=64, max_num_batched_tokens=1024,
              enable_prefix_caching=False)
    reqs = build_workload(llm.get_tokenizer(), num_requests=args.num_requests)
    engine_run(llm, reqs[:2], None, 8)  # warm-up
    ids: dict = {}
    order = list(MODES)
    for rep in range(args.repeats):
        for mode in (order if rep % 2 == 0 else order[::-1]):
            timer = Timed()
            with copying_logprobs() if mode == "lp5_copy" else nullcontext():
                res["sampler_ms"][mode].append(sampler_alone(args.rows, 10, MODES[mode]) * 1e3)
                with timer.active():
                    dt, cpu, toks, ids[mode] = engine_run(llm, reqs, MODES[mode],
                                                          args.max_tokens)
            res["tok_s"][mode].append(toks / dt)
            res["cpu_s"][mode].append(cpu)
            res["share"][mode].append(timer.s / dt)
            print(f"{mode}: {toks} tokens in {dt:.1f} s = {toks / dt:.1f} tok/s, CPU {cpu:.1f} s,"
                  f" {timer.s / dt:.1%} of it in _logprobs; sampler "
                  f"{res['sampler_ms'][mode][-1]:.2f} ms/call ({args.rows} rows); load "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
    res["same_tokens"] = ids["none"] == ids["lp5"] == ids["lp5_copy"]
    res["tokens"] = sum(map(len, ids["none"]))
    for m in ("lp5", "lp5_copy"):
        res[f"{m}_cost_wall_median"] = 1 - (statistics.median(res["tok_s"][m])
                                            / statistics.median(res["tok_s"]["none"]))
        res[f"{m}_cost_cpu_median"] = (statistics.median(res["cpu_s"][m])
                                       / statistics.median(res["cpu_s"]["none"]) - 1)
        print(f"{m} cost against none: wall {res[f'{m}_cost_wall_median']:+.1%}, CPU "
              f"{res[f'{m}_cost_cpu_median']:+.1%} (medians); in _logprobs "
              f"{statistics.median(res['share'][m]):.1%} of its runs' time (median)")
    res["load_avg_end"] = os.getloadavg()
    print(f"same tokens in every mode: {res['same_tokens']}; load {res['load_avg_end']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
