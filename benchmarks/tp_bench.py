"""Tensor parallelism on this CPU: step time and per-step all-reduce time for N = 1, 2, 3 ranks.

Informational: N gloo processes share the machine's cores (2 here, shared with other work), so this
shows the protocol's costs, not a speed-up. Rounds interleave the configurations; each row is the
median over rounds. Also: the one-call C decode stack against the module path at N=1, and the
step broadcast as one packed tensor against broadcast_object_list.

    python benchmarks/tp_bench.py [--rounds 2] [--batch 8] [--new 32]
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))


def synthetic_model(out: Path, tok_src: Path) -> Path:
    """SmolLM2's sizes (hidden 576, 30 layers, MLP 1536, vocab 49152) with 12 heads of 48 over 6 KV
    heads, so that N = 2 and 3 both split it (SmolLM2's 9 heads do not split over 2). Random weights."""
    from tests.tp_helpers import write_tiny

    if not (out / "config.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        write_tiny(out, tok_src, heads=12, kv_heads=6, inter=1536, layers=30, head_dim=48)
    return out


def run_config(path: str, n: int, batch: int, new: int, stack: bool = True, threads: int | None = None) -> dict:
    import torch

    from genpool.engine import LLM, SamplingParams

    llm = LLM(path, tensor_parallel_size=n, num_kv_blocks=256, num_threads=threads or os.cpu_count())
    eng, runner = llm.llm_engine, llm.llm_engine.runner
    if not stack:  # N=1 only: the module path, for the C decode stack's worth
        runner.decode_stack = None
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(100, 40000, (64,), generator=g).tolist()} for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    llm.generate(prompts[:2], params)  # warm-up
    c0, s0 = dict(eng._counters), replace(runner.comm.stats) if n > 1 else None
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    c1 = eng._counters
    steps = c1["step_count"] - c0["step_count"]
    dsteps = c1["decode_steps"] - c0["decode_steps"]
    row = dict(n=n, stack=stack, threads=torch.get_num_threads(), steps=steps, wall_s=wall, step_ms=1e3 * wall / steps,
               decode_step_ms=1e3 * (c1["decode_time_total"] - c0["decode_time_total"]) / dsteps)
    if n > 1:
        s1 = runner.comm.stats
        row.update(all_reduce_ms_per_step=1e3 * (s1.all_reduce_s - s0.all_reduce_s) / steps,
                   all_reduces_per_step=(s1.all_reduce_calls - s0.all_reduce_calls) / steps,
                   broadcast_ms_per_step=1e3 * (s1.broadcast_s - s0.broadcast_s) / steps,
                   gather_ms_per_step=1e3 * (s1.gather_s - s0.gather_s) / steps)
        runner.close()
    del llm, eng, runner
    gc.collect()
    return row


def _bcast_rank(rank: int, init: str, reps: int, out) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    step = {"seqs": [[100 + i, 1, 101 + i, 8] + [i] + list(range(8)) for i in range(16)], "copies": []}
    packed = torch.zeros(4096, dtype=torch.int64)
    res = {}
    for name in ("packed", "object_list"):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            if name == "packed":
                if rank == 0:
                    flat = [v for s in step["seqs"] for v in s]
                    packed[:len(flat)] = torch.tensor(flat)
                dist.broadcast(packed, 0)
                packed[:200].tolist()
            else:
                objs = [step if rank == 0 else None]
                dist.broadcast_object_list(objs, 0)
        res[name] = 1e6 * (time.perf_counter() - t0) / reps
    if rank == 0:
        out.put(res)
    dist.destroy_process_group()


def broadcast_micro(reps: int = 300) -> dict:
    """One decode step's metadata (16 sequences, 8-block tables) sent 2 ways between 2 gloo ranks (us)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q, tmp = ctx.Queue(), tempfile.mkdtemp(prefix="tp-bcast-")
    procs = [ctx.Process(target=_bcast_rank, args=(r, f"file://{tmp}/rdzv", reps, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = q.get(timeout=300)
    for p in procs:
        p.join()
    return res


def key_of(config: tuple, smol) -> str:
    path, n, stack, threads = config
    return (f"{'smollm2' if path == str(smol) else 'synthetic'} N={n}{'' if stack else ' module-path'}"
            f"{f' {threads}-thread' if threads else ''}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--synthetic", default="/tmp/genpool-tp-bench-model")
    ap.add_argument("--only", nargs="*", help="run the configurations whose names contain one of these")
    ap.add_argument("--no-broadcast", action="store_true", help="skip the broadcast micro-benchmark")
    a = ap.parse_args()
    from genpool.engine.models.registry import resolve_model

    smol = resolve_model("smollm2-135m")
    syn = str(synthetic_model(Path(a.synthetic), smol))
    # (model, N, C stack, threads): N ranks share the cores; N=1 also with one thread, the per-rank
    # share at N >= 2 on 2 cores, which keeps OpenMP's barriers out of the comparison
    configs = [(str(smol), 1, True, None), (str(smol), 1, True, 1), (str(smol), 3, True, None),
               (syn, 1, True, None), (syn, 1, True, 1), (syn, 1, False, 1), (syn, 2, True, None),
               (syn, 3, True, None)]
    configs = [c for c in configs if not a.only or any(o in key_of(c, smol) for o in a.only)]
    rows: dict = {}
    for r in range(a.rounds):
        for c in (configs if r % 2 == 0 else configs[::-1]):
            row = run_config(c[0], c[1], a.batch, a.new, c[2], c[3])
            key = key_of(c, smol)
            rows.setdefault(key, []).append(row)
            print(key, {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    print("\nmedian over rounds (batch %d, %d new tokens, 64-token prompts):" % (a.batch, a.new))
    for key, rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if isinstance(rs[0][k], float)}
        print(f"  {key:32s} " + "  ".join(f"{k}={v:.2f}" for k, v in med.items()))
    if not a.no_broadcast:
        print("step broadcast, 2 gloo ranks, us per step:", broadcast_micro())


if __name__ == "__main__":
    main()
