"""kv_cache_dtype="bfloat16" or "int8" under an fp32 model (issue 34): the KV cache holds bf16 K/V,
written rounded and read widened (or int8 K/V with a scale per group of 32, kernels/kvq.py), while
every other tensor stays fp32. It must hold twice (int8: 3.5x) the blocks in the same memory, run on the one-call decode stack and the C prefill kernel, and stay close to the
fp32 cache: SmolLM2's greedy choices are fp32's argmax or within a near-tie of it, teacher-forced
log-probs within a small bound. Other combinations are refused with a clear error, and a resume
knows the cache's dtype (it changes the logits)."""
from __future__ import annotations

import pytest

from genpool.engine import LLM, SamplingParams
from genpool.engine.config import EngineConfig
from genpool.engine.identity import ModelIdentity, model_identity
from tests.prompts import QUESTIONS, chat_ids

# Per cache: nats below fp32's best token that a greedy choice may sit; the most and the mean that a
# teacher-forced log-prob may differ from fp32's. Measured on these 8 x 32 tokens: bf16 median 0.002,
# max 0.03; int8 (groups of 32) median 0.009, max 0.19. A wrong scale or group moves them by nats.
NEAR_TIE = {"bfloat16": 0.15, "int8": 0.4}
MAX_DIFF = {"bfloat16": 0.1, "int8": 0.3}
MEAN_DIFF = {"bfloat16": 0.01, "int8": 0.03}


@pytest.mark.parametrize("dtype,kv", [("bfloat16", "float32"), ("float16", "bfloat16"), ("bfloat16", "int8")])
def test_only_bf16_or_int8_under_fp32_or_the_models_own_dtype(dtype, kv):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(model="m", dtype=dtype, kv_cache_dtype=kv)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(model="m", kv_cache_dtype="int4")
    assert EngineConfig(model="m", dtype="bf16", kv_cache_dtype="bf16").kv_dtype_name == "bfloat16"


def test_a_resume_tells_the_caches_apart(tiny_llama_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama_path))
    fp32 = model_identity(EngineConfig(model=str(tiny_llama_path)), tiny_llama_path, tok)
    same = model_identity(EngineConfig(model=str(tiny_llama_path), kv_cache_dtype="float32"), tiny_llama_path, tok)
    bf16 = model_identity(EngineConfig(model=str(tiny_llama_path), kv_cache_dtype="bf16"), tiny_llama_path, tok)
    assert same == fp32 and same.key == fp32.key and fp32.kv_cache_dtype is None
    assert bf16.key != fp32.key and "kv_cache_dtype None != 'bfloat16'" in fp32.mismatch(bf16)
    int8 = model_identity(EngineConfig(model=str(tiny_llama_path), kv_cache_dtype="int8"), tiny_llama_path, tok)
    assert int8.key not in (fp32.key, bf16.key) and "kv_cache_dtype 'bfloat16' != 'int8'" in bf16.mismatch(int8)
    assert ModelIdentity.from_dict(bf16.to_dict()) == bf16
    old = {k: v for k, v in fp32.to_dict().items() if k != "kv_cache_dtype"}  # a record from before the field
    assert ModelIdentity.from_dict(old) == fp32


@pytest.mark.parametrize("kv", ["bfloat16", "int8"])
def test_smollm2_with_a_narrow_cache_is_fp32s_choice_or_a_near_tie(smollm2_path, kv):
    budget = 64 << 20
    fp32 = LLM(str(smollm2_path), kv_cache_memory=budget)
    bf16 = LLM(str(smollm2_path), kv_cache_memory=budget, kv_cache_dtype=kv)
    r32, r16 = fp32.llm_engine.runner, bf16.llm_engine.runner
    # the same bytes hold twice the tokens (bf16), or 256 / 72 times (int8: 64 bytes and 2 scales a vector)
    assert r16.num_blocks == (2 * r32.num_blocks if kv == "bfloat16" else budget // r16.bytes_per_block)
    assert r16.num_blocks >= (2 if kv == "bfloat16" else 3.5) * r32.num_blocks
    assert r16.decode_stack is not None and r16.kv_caches[0][0].dtype.itemsize == (2 if kv == "bfloat16" else 1)
    tok = fp32.get_tokenizer()
    prompts = [chat_ids(tok, q) for q in QUESTIONS[:8]]
    greedy = SamplingParams(temperature=0, max_tokens=32)
    outs = bf16.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    same, diffs = 0, []
    for p, out in zip(prompts, outs):
        got = list(out.outputs[0].token_ids)
        # fp32's log-probs of the narrow-cache engine's tokens, teacher-forced in one prefill
        scored, = fp32.generate({"prompt_token_ids": p + got}, SamplingParams(max_tokens=0, prompt_logprobs=1))
        again, = bf16.generate({"prompt_token_ids": p + got}, SamplingParams(max_tokens=0, prompt_logprobs=1))
        for pos in range(len(p), len(p) + len(got)):
            want, mine = scored.prompt_logprobs[pos], again.prompt_logprobs[pos]
            token = (p + got)[pos]
            assert want[token] >= max(want.values()) - NEAR_TIE[kv], (pos, token, want)
            assert abs(mine[token] - want[token]) < MAX_DIFF[kv], (pos, mine, want)
            diffs.append(abs(mine[token] - want[token]))
        ref, = fp32.generate({"prompt_token_ids": p}, greedy)
        same += list(ref.outputs[0].token_ids) == got
    mean = sum(diffs) / len(diffs)
    print(f"{kv} KV cache: {same}/{len(prompts)} greedy sequences identical to the fp32 cache's; "
          f"log-probs {mean:.4f} nats from fp32's on average, {max(diffs):.4f} at most")
    assert same >= len(prompts) // 2 and mean < MEAN_DIFF[kv]
