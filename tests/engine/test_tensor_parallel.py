"""Tensor parallelism on tiny random Llamas (gloo, N CPU processes): the split, the shards, parity
with N=1, clear errors for splits the model cannot take, and ranks that live and die as one."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from genpool.engine import SamplingParams
from genpool.engine.config import EngineConfig
from genpool.engine.models.llama import ModelArgs
from genpool.engine.models.tp_linear import plan_shard
from tests.pool_helpers import ROOT, wait_for
from tests.tp_helpers import alive, child_pids, rank_pids, write_tiny


def _args(heads, kv, inter=192, vocab=49152):
    return ModelArgs(vocab_size=vocab, hidden_size=16 * heads, intermediate_size=inter, num_layers=2,
                     num_heads=heads, num_kv_heads=kv, head_dim=16)


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    """4 query heads over 2 KV heads: N=2 splits the KV heads, N=4 replicates each on two ranks."""
    return write_tiny(tmp_path_factory.mktemp("tp_tiny4"), heads=4, kv_heads=2)


def test_plan_splits_heads_and_replicates_kv_heads():
    smol = [plan_shard(_args(9, 3, 1536), r, 3) for r in range(3)]  # SmolLM2's shape
    assert [list(s.q_heads) for s in smol] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert [list(s.kv_heads) for s in smol] == [[0], [1], [2]]
    assert [(s.inter.start, s.inter.stop) for s in smol] == [(0, 512), (512, 1024), (1024, 1536)]
    rep = [plan_shard(_args(4, 2), r, 4) for r in range(4)]  # more ranks than KV heads
    assert [list(s.kv_heads) for s in rep] == [[0], [0], [1], [1]]
    nine = [plan_shard(_args(9, 3, 1539), r, 9) for r in range(9)]
    assert [s.kv_heads.start for s in nine] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    voc = [plan_shard(_args(4, 2, vocab=10), r, 4) for r in range(4)]
    assert [(s.vocab.start, s.vocab.stop) for s in voc] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert {s.vocab_per_rank for s in voc} == {3}


@pytest.mark.parametrize("heads, kv, inter, size, why", [
    (9, 3, 1536, 2, "the 9 attention heads do not split evenly over 2 ranks"),
    (4, 2, 190, 4, "the MLP's 190 columns do not split evenly over 4 ranks"),
    (6, 2, 192, 3, "neither cover whole groups of 3"),
])
def test_unsupported_splits_say_why_and_what_works(heads, kv, inter, size, why):
    with pytest.raises(ValueError, match="sizes that work") as e:
        plan_shard(_args(heads, kv, inter), 0, size)
    assert why in str(e.value) and f"tensor_parallel_size={size}" in str(e.value)


def test_config_and_engine_refuse_bad_sizes(tiny4):
    from genpool.engine import LLM

    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(model="x", tensor_parallel_size=0)
    before = child_pids(os.getpid())
    with pytest.raises(ValueError, match="4 attention heads do not split evenly over 3 ranks"):
        LLM(str(tiny4), tensor_parallel_size=3)
    assert child_pids(os.getpid()) == before  # refused before any rank started


def test_a_start_that_fails_leaves_no_rank_behind(tiny4):
    from genpool.engine import LLM

    with pytest.raises(ValueError, match="holds no"):
        LLM(str(tiny4), tensor_parallel_size=2, kv_cache_memory=1)  # after the ranks started
    wait_for(lambda: not any(alive(p) for p in rank_pids(os.getpid())), timeout=10, what="rank 1 gone")
    llm = LLM(str(tiny4), tensor_parallel_size=2, num_kv_blocks=8)  # and the process can start another
    llm.llm_engine.runner.close()


def test_engines_close_and_a_second_one_starts(tiny4):
    """LLM.close() and `with` stop the ranks and free the KV cache; an engine whose LLM was
    deleted without close() no longer blocks the next one (one process group per process)."""
    from genpool.engine import LLM

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(str(tiny4), tensor_parallel_size=2, num_kv_blocks=8) as llm:
        first = llm.generate(PROMPTS[:2], params)
        assert rank_pids(os.getpid())
    wait_for(lambda: not any(alive(p) for p in rank_pids(os.getpid())), timeout=10, what="ranks gone")
    assert llm.llm_engine.runner.kv_caches == [] and llm.llm_engine.runner.model is None
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(PROMPTS[:1], params)
    llm.close()  # idempotent
    llm = LLM(str(tiny4), tensor_parallel_size=2, num_kv_blocks=8)
    del llm  # never closed
    llm = LLM(str(tiny4), tensor_parallel_size=2, num_kv_blocks=8)
    try:
        with pytest.raises(RuntimeError, match="already running.*LLM.close"):
            LLM(str(tiny4), tensor_parallel_size=2, num_kv_blocks=8)  # while one is still referenced
        again = llm.generate(PROMPTS[:2], params)
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    finally:
        llm.close()


def test_ranks_share_out_the_cores_this_process_may_run_on(tiny4):
    """Without --num-threads, the ranks share out the cores the worker is pinned to (taskset,
    a cpuset), not every core of the machine: pinned to one core, two ranks get a thread each,
    and pinned to one core with one rank's share, that rank gets one thread, not os.cpu_count()."""
    code = ("from genpool.engine.config import EngineConfig\n"
            "from genpool.engine.tp_runner import _threads_per_rank\n"
            f"print(_threads_per_rank(EngineConfig(model={str(tiny4)!r}, tensor_parallel_size=1)),"
            f" _threads_per_rank(EngineConfig(model={str(tiny4)!r}, tensor_parallel_size=2)))")
    one_core = min(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         preexec_fn=lambda: os.sched_setaffinity(0, {one_core}))
    assert out.stdout.split() == ["1", "1"]


def test_cpu_kv_budget_is_the_workers_not_each_ranks(tiny4):
    """N ranks on one host hold kv_cache_memory in all: here each rank half the budget, half the
    KV heads, so as many blocks as one rank would have."""
    from genpool.engine import LLM

    budget = 8 << 20
    per_block_one_rank = 2 * 2 * 16 * 2 * 16 * 4  # K+V, 2 layers, 16 slots, 2 KV heads of 16 fp32
    llm = LLM(str(tiny4), tensor_parallel_size=2, kv_cache_memory=budget)
    try:
        runner = llm.llm_engine.runner
        assert runner.num_blocks == budget // per_block_one_rank
        held = sum(k.numel() * k.element_size() * 2 for k, _ in runner.kv_caches)
        assert held <= budget // 2
    finally:
        llm.llm_engine.runner.close()


def test_each_rank_loads_only_its_shard(tiny4):
    from genpool.engine.models.tp_loader import load_shard

    full = load_file(str(tiny4 / "model.safetensors"))
    total = sum(t.numel() for t in full.values())
    for r in range(4):
        m = load_shard(tiny4, r, 4, comm=None)
        held = sum(p.numel() for p in m.parameters() if p is not m.lm_head.weight_t)  # tied: a copy
        assert held < total / 4 * 1.1  # a quarter, plus the replicated KV heads and norms
        q = full["model.layers.1.self_attn.q_proj.weight"][16 * r:16 * (r + 1)]
        k = full["model.layers.1.self_attn.k_proj.weight"][16 * (r // 2):16 * (r // 2 + 1)]
        qkv = m.model.layers[1].self_attn.qkv.weight_t
        assert torch.equal(qkv[:, :16], q.t()) and torch.equal(qkv[:, 16:32], k.t())
        down = full["model.layers.0.mlp.down_proj.weight"][:, 48 * r:48 * (r + 1)]
        assert torch.equal(m.model.layers[0].mlp.down_proj.weight_t, down.t())
        vpr = full["model.embed_tokens.weight"].shape[0] // 4  # the tiny vocab splits evenly in 4
        emb = full["model.embed_tokens.weight"][vpr * r:vpr * (r + 1)]
        assert torch.equal(m.model.embed_tokens.weight, emb)


PROMPTS = ["Hello there, how are", "The river stone lamp harbor", "Record 3: copper garden market cloud",
           "Tell me about winter signal paper engine and more words to make it longer"] * 2


@pytest.mark.parametrize("size", [2, 4])
def test_parity_with_one_rank_batched_chunked_preempted(tiny4, size):
    """Greedy and seeded (n=2: copy-on-write block copies go through the broadcast too) requests,
    a 16-token step budget (chunked prefill) and a KV cache small enough to preempt."""
    from genpool.engine import LLM

    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 7 + [
        SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=24, ignore_eos=True)]
    kw = dict(num_kv_blocks=10, max_num_batched_tokens=16, enable_prefix_caching=False)
    want = LLM(str(tiny4), **kw).generate(PROMPTS, params)
    llm = LLM(str(tiny4), tensor_parallel_size=size, **kw)
    try:
        got = llm.generate(PROMPTS, params)
        stats, runner = llm.llm_engine.stats(), llm.llm_engine.runner
        assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
        assert stats["num_preemptions"] > 0 and stats["step_count"] > sum(len(p) for p in PROMPTS) // 16 // 4
        assert runner.kv_caches[0][0].shape[2] == 1  # one KV head per rank: split (N=2) or replicated (N=4)
        if runner.kern.name == "cpu":  # decode steps take the C stack (all-reduces called back from C)
            # where a rank's MLP columns are whole SwiGLU panels (N=2: 96; N=4: 48, whole panels of
            # AVX2's 16 columns but not of AVX-512's 32), else the module path
            from genpool.kernels.cpu.gemm import panel_width

            whole = (192 // size) % panel_width() == 0
            assert (runner.decode_stack is not None) == whole
        assert runner.comm.stats.broadcasts == stats["step_count"]  # one broadcast per step
        assert runner.comm.stats.all_reduce_calls >= stats["step_count"] * 2 * 2  # o_proj + down per layer
        ranks = [p.pid for p in runner.procs.values()]
    finally:
        llm.llm_engine.runner.close()
    assert len(ranks) == size - 1 and not any(alive(p) for p in ranks)


KILL_SCRIPT = """
import sys, time
from genpool.engine import LLM
if __name__ == "__main__":
    llm = LLM(sys.argv[1], num_kv_blocks=16, tensor_parallel_size=2)
    print("ready", llm.llm_engine.runner._tmp, flush=True)
    time.sleep(120)
"""


def test_ranks_exit_when_rank_0_is_killed(tiny4, tmp_path):
    script = tmp_path / "tp_leader.py"
    script.write_text(KILL_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(tiny4)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=dict(os.environ))
    children: list[int] = []
    try:
        ready, rendezvous = proc.stdout.readline().decode().split()
        assert ready == "ready" and os.path.isdir(rendezvous)
        children = child_pids(proc.pid)  # rank 1 (and multiprocessing's resource tracker)
        assert len(rank_pids(proc.pid)) == 1
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        t0 = time.monotonic()
        wait_for(lambda: not any(alive(c) for c in children), timeout=10, what="rank 1 to exit")
        assert time.monotonic() - t0 < 5
        assert not os.path.exists(rendezvous)  # rank 1 removed what the killed rank 0 could not
    finally:
        for c in children:
            if alive(c):
                os.kill(c, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


TRITON_SCRIPT = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported here and in the spawned rank
from genpool.engine import LLM, SamplingParams
if __name__ == "__main__":
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = ["Hello there, how are", "The river stone lamp harbor"]
    one = LLM(sys.argv[1], num_kv_blocks=16, kernel_backend="triton").generate(prompts, p)
    llm = LLM(sys.argv[1], num_kv_blocks=16, kernel_backend="triton", tensor_parallel_size=2)
    two = llm.generate(prompts, p)
    assert llm.llm_engine.runner.kern.name == "triton"
    llm.llm_engine.runner.close()
    print([o.outputs[0].token_ids for o in one] == [o.outputs[0].token_ids for o in two])
"""


def test_triton_backend_per_rank(tiny4, tmp_path):
    """Each rank runs the Triton kernels (on the CPU: Triton's interpreter, so tiny and short)."""
    pytest.importorskip("triton")
    script = tmp_path / "tp_triton.py"
    script.write_text(TRITON_SCRIPT)
    out = subprocess.run([sys.executable, str(script), str(tiny4)], cwd=ROOT, capture_output=True, timeout=600,
                         env=dict(os.environ))
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    assert out.stdout.decode().strip().splitlines()[-1] == "True"
