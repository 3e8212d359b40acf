"""The shipped SmolLM2 Q4_1 GGUF loaded natively (4-bit weights, Q8_0 embeddings) against its fp32
unpacking (the converted checkpoint, whose tensors are the file's dequantized ones, bit for bit):
the same weights, so the same greedy tokens on the engine parity prompts (a near-tie allowed, as
in tests/engine/test_engine_parity.py). Products run on fp32 FMAs here (GENPOOL_QUANT_COMPUTE=fp32): with
int8 dot products (the default on VNNI CPUs) or bf16 prompt products, the activations carry
int8 / bf16 rounding, whose effect benchmarks/quant_modes.py measures (KL, perplexity, agreement),
and the last test here bounds."""
from __future__ import annotations

from genpool.engine import LLM, SamplingParams
from genpool.engine.models.llama import Linear
from tests.engine.test_engine_parity import MAX_TOKENS, assert_parity
from tests.prompts import QUESTIONS, SHARED_QUESTIONS, SHARED_SYSTEM, chat_ids

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


def test_native_q4_1_gives_the_fp32_unpacking_greedy_tokens(smollm2_path, monkeypatch):
    from genpool.kernels.cpu import qgemm as cpu_qgemm
    monkeypatch.setenv("GENPOOL_QUANT_COMPUTE", "fp32")
    cpu_qgemm.compute_mode.cache_clear()
    llm = LLM(str(smollm2_path), dtype="float32", num_kv_blocks=512, quantization="gguf")
    model = llm.llm_engine.runner.model
    layer = model.model.layers[0]
    assert layer.mlp.gate_up.packed.fmt == "Q4_1" and layer.mlp.gate_up.weight_t is None
    assert model.lm_head.packed.fmt == "Q8_0" and model.model.embed_tokens.qweight.fmt == "Q8_0"
    weight_bytes = sum(m.packed.nbytes for m in model.modules() if isinstance(m, Linear))
    assert weight_bytes < 134_500_000 * 4 / 4  # fp32 would hold ~538 MB; 4.5-9 bits per weight here
    tok = llm.get_tokenizer()
    prompts = [chat_ids(tok, q) for q in QUESTIONS] + [chat_ids(tok, q, SHARED_SYSTEM) for q in SHARED_QUESTIONS]
    native = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    del llm
    fp32 = LLM(str(smollm2_path), dtype="float32", num_kv_blocks=512)
    want = [o.outputs[0].token_ids for o in fp32.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    assert_parity(smollm2_path, prompts, native, want)
    same = sum(o.outputs[0].token_ids == w for o, w in zip(native, want))
    print(f"native Q4_1: {same}/{len(prompts)} sequences identical to fp32's")
    cpu_qgemm.compute_mode.cache_clear()
