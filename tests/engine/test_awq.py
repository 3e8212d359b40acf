"""AWQ checkpoints: the test writes one by quantizing a tiny Llama (int4, group 128, zero points, AutoAWQ's
packed layout), then checks that loading it dequantizes to exactly the values written and that the
engine runs it."""
from __future__ import annotations

import json

import pytest
import torch

from genpool.engine.models.awq import pack_int4, unpack_int4
from tests.tiny_tokenizer import VOCAB_SIZE, write_tiny_tokenizer

GROUP = 128
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")


def _quantize_group(w_t: torch.Tensor):
    """W^T [K, N] -> (q [K, N], zeros [K/G, N], scales fp16 [K/G, N]): asymmetric 4-bit per group of inputs."""
    k, n = w_t.shape
    g = w_t.reshape(k // GROUP, GROUP, n)
    lo, hi = g.amin(1), g.amax(1)
    scales = ((hi - lo).clamp(min=1e-5) / 15).half()
    zeros = torch.round(-lo / scales.float()).clamp(0, 15)
    q = torch.round(g / scales.float().unsqueeze(1) + zeros.unsqueeze(1)).clamp(0, 15)
    return q.reshape(k, n).to(torch.int32), zeros.to(torch.int32), scales


@pytest.fixture(scope="module")
def awq_path(tmp_path_factory):
    import transformers
    from safetensors.torch import save_file
    out = tmp_path_factory.mktemp("tiny_awq")
    cfg = transformers.LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                   rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                                   initializer_range=0.1, tie_word_embeddings=True,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    state = transformers.LlamaForCausalLM(cfg).state_dict()
    written, expected = {}, {}
    for name, t in state.items():
        prefix = name.removesuffix(".weight")
        if any(prefix.endswith(p) for p in PROJ):
            q, z, s = _quantize_group(t.t().float())
            written.update({f"{prefix}.qweight": pack_int4(q), f"{prefix}.qzeros": pack_int4(z),
                            f"{prefix}.scales": s})
            # the values written: (q - z) * s, per input group, as [N, K]
            expected[prefix] = ((q.float() - z.float().repeat_interleave(GROUP, 0)) *
                                s.float().repeat_interleave(GROUP, 0)).t()
        elif "rotary" not in name and name != "lm_head.weight":
            written[name] = t.half()
    save_file(written, str(out / "model.safetensors"))
    hf_cfg = cfg.to_dict()
    hf_cfg.update(torch_dtype="float16", quantization_config={"quant_method": "awq", "bits": 4,
                                                              "group_size": GROUP, "version": "gemm",
                                                              "zero_point": True})
    (out / "config.json").write_text(json.dumps(hf_cfg))
    write_tiny_tokenizer(out)
    return out, expected, written


def test_pack_int4_round_trips_in_awq_order():
    ints = torch.randint(0, 16, (3, 16), dtype=torch.int32)
    packed = pack_int4(ints)
    assert packed.dtype == torch.int32 and packed.shape == (3, 2)
    assert torch.equal(unpack_int4(packed), ints)
    one = torch.zeros(1, 8, dtype=torch.int32)
    one[0, 2] = 5  # column 2 is nibble 1 in AWQ's order (0, 2, 4, 6, 1, 3, 5, 7)
    assert int(pack_int4(one)) == 5 << 4


def test_awq_checkpoint_dequantizes_to_exactly_the_values_written(awq_path):
    from genpool.engine.models.loader import load_model
    path, expected, written = awq_path
    model = load_model(path)  # AWQ from config.json, unasked
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        qkv = layer.self_attn.qkv.qweight
        assert (qkv.fmt, qkv.bits, qkv.group) == ("awq", 4, GROUP)
        want = torch.cat([expected[p + f"self_attn.{c}_proj"] for c in "qkv"])
        assert torch.equal(qkv.dequantize(), want)
        assert torch.equal(layer.self_attn.o_proj.qweight.dequantize(), expected[p + "self_attn.o_proj"])
        gate_up = torch.cat([expected[p + "mlp.gate_proj"], expected[p + "mlp.up_proj"]])
        assert torch.equal(layer.mlp.gate_up.qweight.dequantize(), gate_up)
        assert torch.equal(layer.mlp.down_proj.qweight.dequantize(), expected[p + "mlp.down_proj"])
        assert torch.equal(layer.input_layernorm.weight, written[p + "input_layernorm.weight"].float())
    emb = written["model.embed_tokens.weight"].float()
    assert torch.equal(model.model.embed_tokens.weight, emb)
    assert torch.equal(model.lm_head.weight_t, emb.t())  # tied, unquantized (as AWQ leaves it)


def test_engine_runs_the_awq_checkpoint_like_its_dequantized_weights(awq_path, monkeypatch):
    """Greedy tokens through the quantized GEMM on fp32 FMAs match the torch reference backend (which
    multiplies the dequantized weights), within near-ties of fp32 summation order."""
    from genpool.kernels.cpu import qgemm as cpu_qgemm
    monkeypatch.setenv("GENPOOL_QUANT_COMPUTE", "fp32")
    cpu_qgemm.compute_mode.cache_clear()
    try:
        _greedy_matches_the_reference(awq_path[0])
    finally:
        cpu_qgemm.compute_mode.cache_clear()


def _greedy_matches_the_reference(path):
    from genpool.engine import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 100 + i, 2000 + 7 * i, 300]} for i in range(4)]
    fast = LLM(str(path), num_kv_blocks=64)
    assert fast.llm_engine.runner.model.model.layers[0].mlp.down_proj.packed.fmt == "awq"
    ref = LLM(str(path), num_kv_blocks=64, kernel_backend="torch")
    a = [o.outputs[0].token_ids for o in fast.generate(prompts, params)]
    b = [o.outputs[0].token_ids for o in ref.generate(prompts, params)]
    assert sum(x == y for x, y in zip(a, b)) >= 3, (a, b)
    with pytest.raises(ValueError, match="AWQ-quantized"):
        LLM(str(path), num_kv_blocks=64, quantization="int8")


def test_awq_layers_on_int8_dot_products_stay_close_to_the_dequantized_ones(awq_path):
    """The default compute on VNNI CPUs (int8 activations, cpu_qgemm_vnni.c): each quantized layer's
    output within 2% of the torch reference's over the same dequantized weights."""
    from genpool.engine.models.loader import load_model
    from genpool.kernels import get_backend
    from genpool.kernels.cpu import qgemm as cpu_qgemm
    cpu_qgemm.compute_mode.cache_clear()
    if cpu_qgemm.compute_mode() not in cpu_qgemm.DOT_MODES:
        pytest.skip("this CPU or build has no AVX512-VNNI")
    path, _, _ = awq_path
    fast, ref = load_model(path, kern=get_backend("cpu")), load_model(path)
    h = torch.randn(9, fast.args.hidden_size, generator=torch.Generator().manual_seed(0))
    for a, b in zip(fast.model.layers, ref.model.layers):
        assert a.mlp.down_proj.packed.layout == "vnni"
        for got, want in ((a.mlp(h), b.mlp(h)), (a.self_attn.qkv(h), b.self_attn.qkv(h))):
            rel = (got - want).norm() / want.norm()
            assert 0 < rel < 0.02, rel
