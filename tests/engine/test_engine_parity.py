"""Greedy parity with HF transformers `generate` (fp32, same checkpoint) on the real SmolLM2.

Every engine configuration must reproduce HF's tokens: one request at a time, all together,
with prefix caching over shared prefixes, with a tiny token budget (chunked prefill) and with a
KV budget small enough to force preemption. Where fp32 summation order legitimately differs, only
a near-tie is allowed: at the first differing position HF's logits for the two tokens are within
0.02 of each other.
"""
from __future__ import annotations

import pytest

from genpool.engine import LLM, SamplingParams
from tests.hf_ref import hf_greedy, hf_logits
from tests.prompts import QUESTIONS, SHARED_QUESTIONS, SHARED_SYSTEM, chat_ids

MAX_TOKENS = 24
TIE_EPS = 0.02
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def tok(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path))


@pytest.fixture(scope="module")
def prompts(tok):
    plain = [chat_ids(tok, q) for q in QUESTIONS]
    shared = [chat_ids(tok, q, SHARED_SYSTEM) for q in SHARED_QUESTIONS]
    return plain + shared


@pytest.fixture(scope="module")
def reference(smollm2_path, prompts):
    return hf_greedy(smollm2_path, prompts, MAX_TOKENS)


def assert_parity(path, prompts, got_outputs, want):
    for ids, out, ref in zip(prompts, got_outputs, want):
        got = out.outputs[0].token_ids
        if got == ref:
            continue
        k = next(i for i, (a, b) in enumerate(zip(got, ref)) if a != b)
        logits = hf_logits(path, ids + ref[:k])[-1]
        gap = abs(float(logits[got[k]] - logits[ref[k]]))
        assert gap < TIE_EPS, f"diverged at {k}: got {got[k]} want {ref[k]} (logit gap {gap:.4f})"


def _llm(path, **kw):
    kw.setdefault("num_kv_blocks", 512)
    return LLM(str(path), dtype="float32", **kw)


def test_one_at_a_time(smollm2_path, prompts, reference):
    llm = _llm(smollm2_path, enable_prefix_caching=False)
    outs = [llm.generate({"prompt_token_ids": p}, GREEDY)[0] for p in prompts]
    assert_parity(smollm2_path, prompts, outs, reference)
    assert llm.llm_engine.stats()["kv_blocks_used"] == 0


def test_all_together_with_prefix_caching(smollm2_path, prompts, reference):
    llm = _llm(smollm2_path)
    batch = [{"prompt_token_ids": p} for p in prompts]
    first = llm.generate(batch, GREEDY)
    assert_parity(smollm2_path, prompts, first, reference)
    stats = llm.llm_engine.stats()
    # Shared system prompt: later requests of the same batch hit the earlier ones' blocks.
    assert stats["prefix_cache_hits"] > 0
    again = llm.generate(batch, GREEDY)  # now every full prompt block is cached
    assert_parity(smollm2_path, prompts, again, reference)
    hits = llm.llm_engine.stats()["prefix_cache_hits"] - stats["prefix_cache_hits"]
    full_blocks = sum((len(p) - 1) // 16 * 16 for p in prompts)
    assert hits == full_blocks


def test_tiny_token_budget_chunked_prefill(smollm2_path, prompts, reference):
    llm = _llm(smollm2_path, max_num_batched_tokens=32, enable_prefix_caching=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert_parity(smollm2_path, prompts, outs, reference)
    assert llm.llm_engine.stats()["step_count"] >= sum(len(p) for p in prompts) // 32


def test_small_kv_budget_forces_preemption(smollm2_path, prompts, reference):
    need = max(len(p) for p in prompts) + MAX_TOKENS
    llm = _llm(smollm2_path, num_kv_blocks=need // 16 + 6, enable_prefix_caching=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert_parity(smollm2_path, prompts, outs, reference)
    assert llm.llm_engine.stats()["num_preemptions"] > 0


def test_same_seed_same_text_whatever_the_batch(smollm2_path, prompts):
    llm = _llm(smollm2_path)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=MAX_TOKENS)
    alone = llm.generate({"prompt_token_ids": prompts[3]}, seeded)[0].outputs[0]
    others = [{"prompt_token_ids": p} for p in prompts[:6]]
    params = [SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS)] * 6
    mixed = llm.generate(others[:2] + [{"prompt_token_ids": prompts[3]}] + others[2:],
                         params[:2] + [seeded] + params[2:])
    assert mixed[2].outputs[0].text == alone.text
    assert mixed[2].outputs[0].token_ids == alone.token_ids
