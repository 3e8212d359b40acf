"""Engine fault isolation: a request that makes the step fail fails alone, the batch runs on.

Real tiny checkpoints; the poisoned one has NaN in one row of its (untied) embedding, so any
request whose prompt holds that token gets NaN logits, as an overflowing model would.
"""
from __future__ import annotations

import shutil

import pytest
import torch

from genpool.engine import LLM, SamplingParams
from genpool.engine.sampler import FAILED, Sampler, SampleRow

POISON = 1234


@pytest.fixture(scope="module")
def poisoned_path(tmp_path_factory, tiny_qwen2_path):
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("poisoned")
    for f in tiny_qwen2_path.iterdir():
        shutil.copy(f, out / f.name)
    weights = load_file(out / "model.safetensors")
    name = next(k for k in weights if k.endswith("embed_tokens.weight"))
    weights[name][POISON] = float("nan")
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def prompts(n: int) -> list[dict]:
    return [{"prompt_token_ids": [10 + i, 200 + 3 * i, 57, 900 + i]} for i in range(n)]


def test_non_finite_logits_fail_only_their_request(poisoned_path):
    llm = LLM(str(poisoned_path), max_num_seqs=8, num_threads=1)
    clean = prompts(5)
    bad = {"prompt_token_ids": [11, POISON, 57]}
    params = [SamplingParams(max_tokens=6, temperature=0.0),
              SamplingParams(max_tokens=6, temperature=0.8, seed=3),
              SamplingParams(max_tokens=6, temperature=0.0, repetition_penalty=1.2)]
    batch = clean[:2] + [bad] + clean[2:]
    outs = llm.generate(batch, [params[i % 3] for i in range(len(batch))])
    alone = llm.generate(clean, [params[i % 3] for i in [0, 1, 3, 4, 5]])
    assert outs[2].error is not None and outs[2].error.code == "internal"
    assert "non-finite" in outs[2].error.message and outs[2].finished
    good = [o for i, o in enumerate(outs) if i != 2]
    assert [o.error for o in good] == [None] * 5
    assert [o.outputs[0].token_ids for o in good] == [o.outputs[0].token_ids for o in alone]
    assert not llm.llm_engine.requests and llm.llm_engine.block_manager.num_used_blocks == 0


def test_a_forward_pass_that_raises_is_bisected_to_its_cause(tiny_llama_path):
    llm = LLM(str(tiny_llama_path), max_num_seqs=8, num_threads=1)
    eng = llm.llm_engine
    want = llm.generate(prompts(6), SamplingParams(max_tokens=5, temperature=0.0))
    real = eng.runner.execute

    def execute(scheduled, copies):  # a kernel that faults whenever request "bad" is in the batch
        if any(seq.request_id == "bad" for seq, _ in scheduled):
            raise RuntimeError("kernel fault")
        return real(scheduled, copies)

    eng.runner.execute = execute
    for i, p in enumerate(prompts(6)):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=5, temperature=0.0))
        if i == 3:
            eng.add_request("bad", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=5))
    finals, ids = {}, {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            for c in out.outputs:
                ids.setdefault(out.request_id, []).extend(c.token_ids)
            if out.finished:
                finals[out.request_id] = out
    assert finals["bad"].error.code == "internal" and "kernel fault" in finals["bad"].error.message
    assert all(finals[f"r{i}"].error is None for i in range(6))
    assert [ids[f"r{i}"] for i in range(6)] == [w.outputs[0].token_ids for w in want]
    assert eng.block_manager.num_used_blocks == 0


def test_sampler_guards_each_row():
    logits = torch.randn(4, 50)
    logits[1, 7] = float("nan")
    logits[3, 9] = float("inf")
    rows = [SampleRow(SamplingParams(temperature=0.0), [1]),
            SampleRow(SamplingParams(temperature=0.0), [1]),
            SampleRow(SamplingParams(temperature=0.7, seed=1), [1]),
            SampleRow(SamplingParams(temperature=0.7, seed=1, logprobs=2), [1])]
    s = Sampler()
    tokens, lps = s(logits, rows)
    assert tokens[1] == tokens[3] == FAILED and set(s.row_errors) == {1, 3}
    assert tokens[0] == int(logits[0].argmax()) and 0 <= tokens[2] < 50
    assert lps[3] is None and s.row_errors[1].code == "internal"


@pytest.mark.parametrize("kwargs", [dict(repetition_penalty=1e-45), dict(repetition_penalty=1e9),
                                    dict(temperature=1e9), dict(n=10_000), dict(seed=-(2**63) - 1),
                                    dict(seed=2**70), dict(stop=["x" * 5000])])
def test_sampling_params_refuse_values_that_could_overflow(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_stop_token_ids_must_be_in_the_vocabulary(tiny_llama_path):
    eng = LLM(str(tiny_llama_path), max_num_seqs=2, num_threads=1).llm_engine
    with pytest.raises(ValueError, match="stop_token_ids must be in"):
        eng.add_request("x", "hello", SamplingParams(stop_token_ids=[10**9]))
    assert not eng.requests
