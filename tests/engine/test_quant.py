"""Quantized weights: the C kernel against the fp32 GEMM, GGUF loading against the gguf package,
int8 at load, and the real Q4_1 file natively against its fp32 unpacking."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from genpool.engine.models.quant import quantize_int8
from genpool.kernels import settings as kernel_settings_module
from genpool.kernels.cpu import gemm as cpu_gemm
from genpool.kernels.cpu import qgemm as cpu_qgemm
from genpool.kernels.qtensor import QTensor, pack_nibbles

pytestmark = pytest.mark.skipif(not cpu_qgemm.available(), reason="no C compiler for the CPU kernels")


@pytest.fixture
def fp32_compute(monkeypatch):
    """Every product on fp32 FMAs over the widened weight (else VNNI CPUs take int8 dot products,
    and prompt-sized ones bf16 products on bf16 hardware)."""
    monkeypatch.setattr(kernel_settings_module, "_current", None)  # the environment's, not an earlier engine's
    monkeypatch.setenv("GENPOOL_QUANT_COMPUTE", "fp32")
    cpu_qgemm.compute_mode.cache_clear()
    yield
    cpu_qgemm.compute_mode.cache_clear()


def _int4(n: int, k: int, group: int, offsets: bool = True) -> QTensor:
    g = torch.Generator().manual_seed(n * 7 + k)
    ints = torch.randint(0, 16, (n, k), generator=g)
    scale = torch.randn(n, k // group, generator=g).half().float()  # fp16 scales, as GGUF and AWQ store
    off = torch.randn(n, k // group, generator=g).half().float() if offsets else None
    return QTensor(pack_nibbles(ints), scale, off, 4, group, (n, k), "test")


@pytest.mark.parametrize("m,n,k", [(1, 100, 64), (5, 576, 576), (7, 33, 96), (20, 1536, 576), (150, 200, 320)])
@pytest.mark.parametrize("kind", ["int8", "int4", "int4-g128", "int4-no-offset"])
def test_qgemm_is_the_fp32_gemm_over_the_dequantized_weight(m, n, k, kind, fp32_compute):
    torch.manual_seed(m + n + k)
    if kind == "int8":
        w = quantize_int8(torch.randn(n, k))
    elif kind == "int4-g128":
        w = _int4(n, k * 2, 128) if k * 2 % 128 == 0 else _int4(n, 128, 128)
    else:
        w = _int4(n, k, 32, offsets=kind == "int4")
    bias = torch.randn(w.shape[0])
    x = torch.randn(m, w.shape[1])
    dense = w.dequantize()
    got = cpu_qgemm.qgemm(x, cpu_qgemm.QPackedWeight(w, bias))
    want = cpu_gemm.gemm(x, cpu_gemm.PackedWeight(dense.t().contiguous(), bias))
    assert torch.equal(got, want)  # same FMA chains over the same (exactly widened) weights
    torch.testing.assert_close(got, x @ dense.t() + bias, rtol=1e-4, atol=1e-3)


def test_qgemm_rejects_a_wrong_input_width():
    w = cpu_qgemm.QPackedWeight(quantize_int8(torch.randn(8, 64)))
    with pytest.raises(ValueError, match="float32"):
        cpu_qgemm.qgemm(torch.randn(2, 32), w)


def test_int8_per_channel_error_is_within_half_a_step():
    w = torch.randn(64, 256) * torch.logspace(-3, 1, 64).unsqueeze(1)  # channels of very different ranges
    w[5] = 0.0
    q = quantize_int8(w)
    assert q.q.dtype == torch.int8 and q.scale.shape == (64, 1) and q.offset is None
    err = (q.dequantize() - w).abs()
    assert bool((err <= q.scale / 2 + 1e-7).all())
    assert bool((q.dequantize()[5] == 0).all())


def _llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's HF -> GGUF row order for attn_q / attn_k (its convert script's permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tiny_gguf(path, hf_dir) -> dict[str, tuple[str, torch.Tensor]]:
    """The tiny Llama as a GGUF with a mix of Q4_0, Q4_1 and Q8_0 (and F32 norms); returns, per HF
    weight name, its type and the values the file's blocks dequantize to (in HF's row order)."""
    import gguf
    from safetensors.torch import load_file

    from genpool.engine.models.loader import load_config
    args, _ = load_config(hf_dir)
    state = load_file(str(next(hf_dir.glob("*.safetensors"))))
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, val in (("block_count", args.num_layers), ("embedding_length", args.hidden_size),
                     ("feed_forward_length", args.intermediate_size), ("attention.head_count", args.num_heads),
                     ("attention.head_count_kv", args.num_kv_heads)):
        writer.add_uint32(f"llama.{key}", val)
    names = {"q_proj": ("attn_q", "Q4_0"), "k_proj": ("attn_k", "Q4_1"), "v_proj": ("attn_v", "Q8_0"),
             "o_proj": ("attn_output", "Q4_0"), "gate_proj": ("ffn_gate", "Q4_1"), "up_proj": ("ffn_up", "Q4_1"),
             "down_proj": ("ffn_down", "Q8_0")}
    expected = {}

    def put(name, gname, w, ttype, heads=None):
        arr = (w if heads is None else _llama_cpp_permute(w, heads)).numpy().astype(np.float32)
        qt = gguf.GGMLQuantizationType[ttype]
        blocks = gguf.quants.quantize(arr, qt)
        writer.add_tensor(gname, blocks, raw_dtype=qt)
        deq = torch.from_numpy(gguf.quants.dequantize(blocks, qt))
        if heads is not None:  # back to HF's rows
            deq = deq.reshape(heads, deq.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(deq.shape)
        expected[name] = (ttype, deq)

    put("model.embed_tokens.weight", "token_embd.weight", state["model.embed_tokens.weight"], "Q8_0")
    writer.add_tensor("output_norm.weight", state["model.norm.weight"].numpy())
    for i in range(args.num_layers):
        p = f"model.layers.{i}."
        writer.add_tensor(f"blk.{i}.attn_norm.weight", state[p + "input_layernorm.weight"].numpy())
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", state[p + "post_attention_layernorm.weight"].numpy())
        for hf, (gname, ttype) in names.items():
            sub = "self_attn." if hf.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp."
            heads = {"q_proj": args.num_heads, "k_proj": args.num_kv_heads}.get(hf)
            put(f"{p}{sub}{hf}.weight", f"blk.{i}.{gname}.weight", state[f"{p}{sub}{hf}.weight"], ttype, heads)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def test_gguf_q4_0_q4_1_q8_0_load_as_the_file_dequantizes(tiny_llama_path, tmp_path):
    import shutil

    from genpool.engine.models.loader import load_model
    model_dir = tmp_path / "tiny-gguf"
    shutil.copytree(tiny_llama_path, model_dir)
    expected = _write_tiny_gguf(model_dir / "tiny.gguf", tiny_llama_path)
    model = load_model(model_dir, quantization="gguf")
    emb = model.model.embed_tokens.qweight
    assert emb.fmt == "Q8_0" and torch.equal(emb.dequantize(), expected["model.embed_tokens.weight"][1])
    assert model.lm_head.qweight is emb  # tied: one table
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        qkv = layer.self_attn.qkv.qweight
        parts = [expected[f"{p}self_attn.{c}_proj.weight"][1] for c in "qkv"]
        assert qkv is None  # Q4_0 | Q4_1 | Q8_0 cannot share one layout: dequantized
        assert torch.equal(layer.self_attn.qkv.weight_t.t(), torch.cat(parts))
        o = layer.self_attn.o_proj.qweight
        assert (o.fmt, o.bits) == ("Q4_0", 4) and torch.equal(o.dequantize(), expected[p + "self_attn.o_proj.weight"][1])
        gu = layer.mlp.gate_up.qweight
        want = torch.cat([expected[p + "mlp.gate_proj.weight"][1], expected[p + "mlp.up_proj.weight"][1]])
        assert (gu.fmt, gu.bits) == ("Q4_1", 4) and torch.equal(gu.dequantize(), want)
        d = layer.mlp.down_proj.qweight
        assert (d.fmt, d.bits) == ("Q8_0", 8) and torch.equal(d.dequantize(), expected[p + "mlp.down_proj.weight"][1])


def test_gguf_from_another_model_is_refused(tiny_llama_path, tmp_path):
    import json
    import shutil

    from genpool.engine.models.loader import load_model
    model_dir = tmp_path / "tiny-gguf"
    shutil.copytree(tiny_llama_path, model_dir)
    _write_tiny_gguf(model_dir / "tiny.gguf", tiny_llama_path)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["intermediate_size"] *= 2
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="does not match the model config"):
        load_model(model_dir, quantization="gguf")


def test_bad_quantization_names_are_refused():
    from genpool.engine.config import EngineConfig
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(model="x", quantization="int3")


def test_int8_engine_tracks_fp32_on_the_tiny_model(tiny_llama_path):
    """int8 at load: every linear weight int8 (the tied embedding shares the lm_head's table), and the
    last-position logits stay close to fp32's."""
    from genpool.engine.models.loader import load_model
    from genpool.kernels import get_backend
    kern = get_backend("cpu")
    ref = load_model(tiny_llama_path, quantization="int8")  # the torch backend keeps the QTensors
    assert ref.model.embed_tokens.qweight is ref.lm_head.qweight
    assert all(layer.mlp.down_proj.qweight.bits == 8 for layer in ref.model.layers)
    fp32 = load_model(tiny_llama_path, kern=kern)
    int8 = load_model(tiny_llama_path, kern=kern, quantization="int8")
    h = torch.randn(4, fp32.args.hidden_size)
    a, b = fp32.compute_logits(h), int8.compute_logits(h)
    assert isinstance(int8.lm_head.packed, cpu_qgemm.QPackedWeight)
    rel = (a - b).norm() / a.norm()
    assert 0 < rel < 0.02, rel


@pytest.mark.parametrize("layout", ["panels", "vnni"])
@pytest.mark.parametrize("n,k", [(100, 64), (33, 96), (64, 256)])
@pytest.mark.parametrize("kind", ["int8", "int4", "int4-g128", "int4-no-offset"])
def test_packed_weight_rows_dequantize_as_the_qtensor_does(n, k, kind, layout):
    """A tied embedding looks rows up in the lm_head's packed panels: the same bits as the QTensor's
    own dequantize(rows), in any order, repeated, including rows of the last (padded) panel."""
    torch.manual_seed(n + k)
    if kind == "int8":
        w = quantize_int8(torch.randn(n, k))
    elif kind == "int4-g128":
        w = _int4(n, 128 * (k // 64), 128)
    else:
        w = _int4(n, k, 32, offsets=kind == "int4")
    if layout == "vnni" and not cpu_qgemm.vnni_fits(w):
        pytest.skip(f"{kind} weights do not run on this build's dot products")
    packed = cpu_qgemm.QPackedWeight(w, layout=layout)
    assert packed.layout == layout
    rows = torch.tensor([0, n - 1, 3, 3, n // 2, 1, n - 1] + torch.randint(0, n, (20,)).tolist())
    assert torch.equal(packed.dequantize(rows), w.dequantize(rows))
    assert torch.equal(packed.dequantize(torch.arange(n)), w.dequantize())
    assert packed.dequantize(torch.tensor([], dtype=torch.long)).shape == (0, w.shape[1])
    with pytest.raises(IndexError):
        packed.dequantize(torch.tensor([n]))


@pytest.mark.parametrize("quantization", ["int8", "gguf"])
def test_a_tied_quantized_embedding_is_held_once_packed(quantization, tiny_llama_path, tmp_path):
    """On the CPU backend the tied lm_head's packed weight is the embedding's table too (no second
    copy of the QTensor it was packed from), and the looked-up rows are the QTensor's bits."""
    import shutil

    from genpool.engine.models.loader import load_model
    from genpool.kernels import get_backend
    path = tiny_llama_path
    if quantization == "gguf":
        path = tmp_path / "tiny-gguf"
        shutil.copytree(tiny_llama_path, path)
        _write_tiny_gguf(path / "tiny.gguf", tiny_llama_path)
    ref = load_model(path, quantization=quantization)  # the torch backend keeps the QTensor
    model = load_model(path, kern=get_backend("cpu"), quantization=quantization)
    emb = model.model.embed_tokens
    assert emb.qweight is model.lm_head.packed and isinstance(emb.qweight, cpu_qgemm.QPackedWeight)
    assert model.lm_head.qweight is None
    ids = torch.tensor([[0, 5, 5, ref.args.vocab_size - 1], [7, 1, 2, 3]])
    got = emb(ids)
    assert got.shape == (2, 4, ref.args.hidden_size)
    assert torch.equal(got, ref.model.embed_tokens(ids))


@pytest.mark.parametrize("m", [1, 7, 150])
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_qgemm_swiglu_is_silu_mul_of_the_product(m, kind, fp32_compute):
    from genpool.kernels.cpu import silu_mul as cpu_silu_mul
    inter, k = 2 * cpu_qgemm.panel_width() * 3, 96
    w = quantize_int8(torch.randn(2 * inter, k)) if kind == "int8" else _int4(2 * inter, k, 32)
    packed = cpu_qgemm.QPackedWeight(w)
    x = torch.randn(m, k)
    got = cpu_qgemm.qgemm_swiglu(x, packed)
    assert torch.equal(got, cpu_silu_mul.silu_and_mul(cpu_qgemm.qgemm(x, packed)))


@pytest.mark.parametrize("fixture", ["tiny_llama_path", "tiny_qwen2_path"])
def test_the_decode_stack_takes_int8_weights_with_the_module_paths_bits(fixture, request):
    """The one-call decoder stack runs quantized layers (no fallback to the modules), and gives the
    bits the module path gives (tests/kernels/test_kernels_cpu_decode_layers.py's check)."""
    from genpool.engine.config import EngineConfig
    from genpool.engine.model_runner import ModelRunner
    from tests.kernels.test_kernels_cpu_decode_layers import _decode_steps_match, _prefilled
    path = request.getfixturevalue(fixture)
    runner = ModelRunner(EngineConfig(model=str(path), num_kv_blocks=32, quantization="int8"), path, 256)
    assert isinstance(runner.model.model.layers[0].self_attn.qkv.packed, cpu_qgemm.QPackedWeight)
    _decode_steps_match(runner, _prefilled(runner, [5, 16, 31, 47]))
    assert runner.decode_stack is not None


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_bf16_widening_rounds_the_dequantized_weight_to_nearest_even(kind):
    if cpu_qgemm._widen_bf16_kernel() is None:
        pytest.skip("no kernel")
    n, k = 70, 96  # a partial last panel
    w = quantize_int8(torch.randn(n, k)) if kind == "int8" else _int4(n, k, 32)
    got = cpu_qgemm.widen_bf16(cpu_qgemm.QPackedWeight(w, layout="panels"))
    assert torch.equal(got, w.dequantize().t().to(torch.bfloat16))


@pytest.mark.parametrize("mode", ["auto", "bf16", "fp32"])
def test_prompt_sized_products_stay_close_in_every_compute_mode(mode, monkeypatch):
    """Prompt-sized batches take int8 dot products (VNNI CPUs) or bf16 products (bf16 hardware) by
    default; GENPOOL_QUANT_COMPUTE=fp32 keeps the fp32 GEMM's bits. Each is close to the exact product."""
    monkeypatch.setattr(kernel_settings_module, "_current", None)  # the environment's, not an earlier engine's
    monkeypatch.setenv("GENPOOL_QUANT_COMPUTE", mode)
    cpu_qgemm.compute_mode.cache_clear()
    try:
        w = _int4(256, 192, 32)
        packed, x = cpu_qgemm.QPackedWeight(w), torch.randn(cpu_qgemm.BF16_PREFILL_ROWS + 3, 192)
        exact = x @ w.dequantize().t()
        got = cpu_qgemm.qgemm(x, packed)
        assert ((got - exact).norm() / exact.norm()) < 1e-2
        if cpu_qgemm.compute_mode() == "fp32":
            assert packed.layout == "panels"
            assert torch.equal(got, cpu_gemm.gemm(x, cpu_gemm.PackedWeight(w.dequantize().t().contiguous())))
        assert packed.layout == ("vnni" if cpu_qgemm.compute_mode() in cpu_qgemm.DOT_MODES else "panels")
    finally:
        cpu_qgemm.compute_mode.cache_clear()


_ISA_SCRIPT = r"""
import sys, torch
from genpool.kernels.cpu import build as cpu_build
cpu_build.CFLAGS[cpu_build.CFLAGS.index("-march=native")] = "-march=" + sys.argv[1]
from genpool.kernels.cpu import gemm as cpu_gemm, qgemm as cpu_qgemm
from genpool.kernels.qtensor import QTensor, pack_nibbles
from genpool.engine.models.quant import quantize_int8
torch.manual_seed(0)
print("panel", cpu_qgemm.panel_width(), cpu_gemm.panel_width())
for m, n, k in [(1, 100, 64), (7, 48, 96), (60, 80, 64)]:
    ints = torch.randint(0, 16, (n, k))
    w4 = QTensor(pack_nibbles(ints), torch.randn(n, k // 32).half().float(), torch.randn(n, k // 32).half().float(),
                 4, 32, (n, k), "t")
    for w in (quantize_int8(torch.randn(n, k)), w4):
        x = torch.randn(m, k)
        got = cpu_qgemm.qgemm(x, cpu_qgemm.QPackedWeight(w))
        assert torch.equal(got, cpu_gemm.gemm(x, cpu_gemm.PackedWeight(w.dequantize().t().contiguous()))), (m, n, k)
print("ok")
"""


@pytest.mark.parametrize("march,panel", [("haswell", 16), ("x86-64", 16)])
def test_avx2_and_portable_builds_give_the_same_bits(march, panel, tmp_path):
    """The AVX2 and the portable (no AVX) widening paths, built for those ISAs (this CPU runs both)."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, GENPOOL_HOME=str(tmp_path), GENPOOL_QUANT_COMPUTE="fp32")
    res = subprocess.run([sys.executable, "-P", "-c", _ISA_SCRIPT, march], env=env, capture_output=True, text=True,
                         timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"panel {panel} {panel}" in res.stdout and "ok" in res.stdout


def test_bf16_engine_runs_quantized_weights_on_both_cpu_backends(tiny_llama_path):
    from genpool.engine import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for backend in ("cpu", "torch"):
        llm = LLM(str(tiny_llama_path), dtype="bfloat16", num_kv_blocks=32, quantization="int8", kernel_backend=backend)
        out = llm.generate({"prompt_token_ids": [1, 50, 60, 70]}, params)[0]
        assert len(out.outputs[0].token_ids) == 6
