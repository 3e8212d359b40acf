"""Greedy parity of SmolLM2 split over 3 gloo ranks (9 query heads, 3 KV heads: 3 + 1 per rank) with
the same engine on one rank, on the engine parity prompts: batched, with prefix caching, a 32-token
step budget (chunked prefill) and a KV cache small enough to preempt.

Row-parallel layers sum their partial products in another order than one rank does, so as in
tests/engine/test_engine_parity.py only a near-tie may differ: at the first differing position HF's
logits for the two tokens are within 0.02 of each other.
"""
from __future__ import annotations

import gc
from dataclasses import replace

import pytest

from genpool.engine import SamplingParams
from tests.engine.test_engine_parity import assert_parity
from tests.prompts import QUESTIONS, SHARED_QUESTIONS, SHARED_SYSTEM, chat_ids

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def prompts(smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_path))
    return [chat_ids(tok, q) for q in QUESTIONS] + [chat_ids(tok, q, SHARED_SYSTEM) for q in SHARED_QUESTIONS]


@pytest.fixture(scope="module")
def one_rank(smollm2_path, prompts):
    """N=1's greedy tokens (the engine is dropped before any N=3 engine loads: one model at a time)."""
    from genpool.engine import LLM

    llm = LLM(str(smollm2_path), num_kv_blocks=512)
    want = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    del llm
    gc.collect()
    return want


def _run_tp3(path, prompts, **kw):
    from genpool.engine import LLM

    llm = LLM(str(path), tensor_parallel_size=3, **kw)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        runner = llm.llm_engine.runner
        return outs, llm.llm_engine.stats(), (runner.kv_caches[0][0].shape, replace(runner.comm.stats))
    finally:
        llm.llm_engine.runner.close()


def test_tp3_batched_chunked_preempted_prefix_cached(smollm2_path, prompts, one_rank):
    """One N=3 engine (each start loads three shards: kept to one for time): every prompt at once,
    a 32-token step budget, prefix caching over the shared system prompt, a KV cache that preempts."""
    need = max(len(p) for p in prompts) + MAX_TOKENS
    outs, stats, (kv_shape, comm) = _run_tp3(smollm2_path, prompts, num_kv_blocks=need // 16 + 6,
                                             max_num_batched_tokens=32)
    assert_parity(smollm2_path, prompts, outs, one_rank)
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["step_count"] >= sum(len(p) for p in prompts) // 32
    assert kv_shape[2] == 1  # each rank: one of the 3 KV heads
    assert comm.broadcasts == stats["step_count"]  # one broadcast per step
    assert comm.all_reduce_calls >= 2 * 30 * stats["step_count"]  # o_proj and down of 30 layers
