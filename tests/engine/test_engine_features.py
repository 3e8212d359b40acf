"""Engine behaviour on tiny random-weight checkpoints (fast): parity with HF for Llama and
Qwen2 (qkv bias), n > 1 with copy-on-write, priorities, abort, stops, streaming deltas, memory."""
from __future__ import annotations

import pytest

from genpool.engine import LLM, SamplingParams
from genpool.engine.resume import ResumeState
from tests.hf_ref import hf_greedy

PROMPTS = [list(range(5 + i, 5 + i + n)) for i, n in enumerate([1, 7, 16, 23, 40, 64, 90, 150])]


@pytest.fixture(scope="module")
def tiny(tiny_llama_path):
    return LLM(str(tiny_llama_path), num_kv_blocks=256, max_num_seqs=16)


@pytest.mark.parametrize("which", ["tiny_llama_path", "tiny_qwen2_path"])
def test_greedy_parity_with_hf(request, which):
    path = request.getfixturevalue(which)
    want = hf_greedy(path, PROMPTS, 12, ignore_eos=True)
    llm = LLM(str(path), num_kv_blocks=128, max_num_batched_tokens=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == want


def test_n_samples_share_prompt_blocks_with_copy_on_write(tiny):
    eng = tiny.llm_engine
    prompt = {"prompt_token_ids": list(range(100, 137))}  # 37 tokens: last block partial + shared
    sp = SamplingParams(n=3, temperature=1.0, seed=42, max_tokens=10, ignore_eos=True)
    eng.add_request("fork", prompt, sp)
    while not any(len(s.output_token_ids) for s in eng.requests["fork"].seqs):
        eng.step()
    seqs = eng.requests["fork"].seqs
    assert len(seqs) == 3
    tables = [s.block_table for s in seqs]
    assert tables[0] == tables[1] == tables[2]  # shared right after the fork
    assert all(eng.block_manager.blocks[b].ref_count == 3 for b in tables[0])
    eng.step()  # every child writes into the shared partial block -> two copies
    last = [s.block_table[2] for s in seqs]
    assert len(set(last)) == 3
    assert [s.block_table[:2] for s in seqs] == [tables[0][:2]] * 3  # full blocks stay shared
    while eng.has_unfinished_requests():
        eng.step()
    full = eng.requests.get("fork")
    assert full is None and eng.stats()["kv_blocks_used"] == 0
    # Each forked sample equals the same completion run as its own sequence (a resume from no
    # tokens: no fork, no shared blocks), keyed alike: the shared K/V was never corrupted.
    outs = tiny.generate(prompt, sp)[0].outputs
    eng.add_request("apart", prompt, sp, resume=ResumeState([[], [], []]))
    apart = eng.requests["apart"]
    while eng.has_unfinished_requests():
        eng.step()
    assert [o.token_ids for o in outs] == [o.token_ids for o in apart.full_output().outputs]
    alone = tiny.generate(prompt, sp.clone(n=1))[0]  # sample 0 is the n=1 request's
    assert outs[0].token_ids == alone.outputs[0].token_ids


def test_priority_overtakes_and_preempts(tiny_llama_path):
    llm = LLM(str(tiny_llama_path), num_kv_blocks=64, max_num_seqs=2)
    eng = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i in range(4):
        eng.add_request(f"bulk{i}", {"prompt_token_ids": PROMPTS[4]}, sp, priority=5)
    eng.step()
    eng.add_request("vip", {"prompt_token_ids": PROMPTS[3]}, sp, priority=-1)
    outs = eng.step()
    assert "vip" in [o.request_id for o in outs]  # first token in the very next step
    assert eng.stats()["num_preemptions"] >= 1
    done = []
    while eng.has_unfinished_requests():
        done += [o.request_id for o in eng.step() if o.finished]
    # bulk1 (the latest running) was preempted for vip; vip finishes right after bulk0,
    # which had a one-step head start, and before every other bulk request.
    assert done[:2] == ["bulk0", "vip"] and sorted(done) == ["bulk0", "bulk1", "bulk2", "bulk3", "vip"]


def test_abort_frees_blocks(tiny):
    eng = tiny.llm_engine
    eng.add_request("a", {"prompt_token_ids": PROMPTS[6]}, SamplingParams(max_tokens=50))
    eng.step()
    assert eng.stats()["kv_blocks_used"] > 0
    eng.abort_request("a")
    assert eng.stats()["kv_blocks_used"] == 0 and not eng.has_unfinished_requests()
    outs = eng.step()
    assert outs[0].finished and outs[0].outputs[0].finish_reason == "abort"


def test_stops_limits_and_streaming_deltas(tiny):
    eng = tiny.llm_engine
    base = tiny.generate({"prompt_token_ids": PROMPTS[5]},
                         SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 20
    stop_tok = base.token_ids[5]
    o = tiny.generate({"prompt_token_ids": PROMPTS[5]}, SamplingParams(
        temperature=0, max_tokens=20, stop_token_ids=[stop_tok], ignore_eos=True))[0].outputs[0]
    assert o.token_ids == base.token_ids[:base.token_ids.index(stop_tok) + 1]
    assert o.finish_reason == "stop" and o.stop_reason == stop_tok
    if len(base.text) > 8:
        stop_str = base.text[4:8]
        o = tiny.generate({"prompt_token_ids": PROMPTS[5]}, SamplingParams(
            temperature=0, max_tokens=20, stop=[stop_str], ignore_eos=True))[0].outputs[0]
        assert o.text == base.text[:base.text.index(stop_str)] and o.finish_reason == "stop"
    eng.add_request("s", {"prompt_token_ids": PROMPTS[5]},
                    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3))
    text, ids, lps = "", [], []
    while eng.has_unfinished_requests():
        for out in eng.step():
            text += out.outputs[0].text
            ids += out.outputs[0].token_ids
            lps += out.outputs[0].logprobs
    assert text == base.text and ids == base.token_ids
    assert all(t in lp and len(lp) >= 3 for t, lp in zip(ids, lps))


def test_bad_requests_raise_clear_errors(tiny):
    eng = tiny.llm_engine
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("e", {"prompt_token_ids": []})
    with pytest.raises(ValueError, match="token ids"):
        eng.add_request("v", {"prompt_token_ids": [10**9]})
    with pytest.raises(ValueError, match="limit"):
        eng.add_request("l", {"prompt_token_ids": [5] * 5000})
    eng.add_request("dup", "hello")
    with pytest.raises(ValueError, match="already"):
        eng.add_request("dup", "hello")
    eng.abort_request("dup")
    eng.step()


def _peak_blocks(path, caching: bool, prefix: list[int]) -> int:
    llm = LLM(str(path), num_kv_blocks=2048, max_num_seqs=64, max_num_batched_tokens=4096,
              enable_prefix_caching=caching)
    eng, peak = llm.llm_engine, 0
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i in range(50):
        eng.add_request(f"p{i}", {"prompt_token_ids": prefix + [1000 + i, 7, 8 + i]}, sp)
    while eng.has_unfinished_requests():
        eng.step()
        peak = max(peak, eng.stats()["kv_blocks_used"])
    return peak


def test_shared_prefix_memory_at_most_45_percent(tiny_llama_path):
    prefix = [(i * 37) % 2000 + 10 for i in range(500)]  # 500 distinct ids below the tiny vocab (2048)
    on, off = _peak_blocks(tiny_llama_path, True, prefix), _peak_blocks(tiny_llama_path, False, prefix)
    print(f"50 requests, 500-token shared prefix: peak KV blocks {on} with prefix caching, "
          f"{off} without ({on / off:.1%})")
    assert on <= 0.45 * off


def test_a_cpu_engine_pinned_to_fewer_cores_runs_that_many_threads(tiny_llama_path):
    """Without num_threads the engine never runs more threads than the cores it may run on
    (taskset, a cpuset): a thread count above them, as a torch whose default counts every core
    would give, comes down to the pinned cores."""
    import os
    import subprocess
    import sys

    code = ("import torch\n"
            "torch.set_num_threads(2)\n"
            "from genpool.engine import LLM\n"
            f"llm = LLM({str(tiny_llama_path)!r}, device='cpu', num_kv_blocks=16)\n"
            "print(torch.get_num_threads())\n")
    one_core = min(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         preexec_fn=lambda: os.sched_setaffinity(0, {one_core}))
    assert out.stdout.split()[-1] == "1"
