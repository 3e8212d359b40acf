"""Counter-based randomness (engine/randomness.py) and the model identity (engine/identity.py)."""
from __future__ import annotations

import math

import torch

from genpool.engine.config import EngineConfig
from genpool.engine.identity import ModelIdentity, model_identity
from genpool.engine.randomness import counter_uniform, sample_inverse_cdf


def test_counter_uniform_is_a_pure_function_of_its_key():
    assert counter_uniform(1, 2, 3) == counter_uniform(1, 2, 3)
    keys = [(s, i, k) for s in (0, 1, 2**62) for i in range(3) for k in range(50)]
    values = {counter_uniform(*key) for key in keys}
    assert len(values) == len(keys)  # every key its own draw (collisions: ~2^-53)
    assert counter_uniform(1, 2, 3) != counter_uniform(1, 3, 2)  # the words are not symmetric
    assert all(0.0 <= v < 1.0 for v in values)


def test_counter_uniform_is_uniform():
    u = torch.tensor([counter_uniform(7, 0, k) for k in range(20000)])
    assert abs(float(u.mean()) - 0.5) < 0.01
    hist = torch.histc(u, bins=10, min=0, max=1) / len(u)
    assert float((hist - 0.1).abs().max()) < 0.01


def test_inverse_cdf_picks_by_interval_and_never_a_zero_probability():
    probs = torch.tensor([0.0, 0.25, 0.0, 0.5, 0.25, 0.0])
    assert sample_inverse_cdf(probs, 0.0) == 1
    assert sample_inverse_cdf(probs, 0.2499) == 1
    assert sample_inverse_cdf(probs, 0.25) == 3
    assert sample_inverse_cdf(probs, 0.7501) == 4
    assert sample_inverse_cdf(probs, math.nextafter(1.0, 0.0)) == 4  # never the zero tail
    unnormalised = probs * 3.0
    assert sample_inverse_cdf(unnormalised, 0.6) == 3


def test_identity_same_config_same_identity_int8_and_fp32_differ(tiny_llama_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama_path))
    fp32 = model_identity(EngineConfig(model=str(tiny_llama_path)), tiny_llama_path, tok)
    again = model_identity(EngineConfig(model=str(tiny_llama_path)), tiny_llama_path, tok)
    int8 = model_identity(EngineConfig(model=str(tiny_llama_path), quantization="int8"),
                          tiny_llama_path, tok)
    bf16 = model_identity(EngineConfig(model=str(tiny_llama_path), dtype="bf16"),
                          tiny_llama_path, tok)
    assert fp32 == again and fp32.key == again.key and fp32.mismatch(again) is None
    assert int8.key != fp32.key and "quantization None != 'int8'" in fp32.mismatch(int8)
    assert bf16.dtype == "bfloat16" and "dtype" in fp32.mismatch(bf16)
    assert ModelIdentity.from_dict(fp32.to_dict()) == fp32


def test_identity_tracks_the_weights(tiny_llama_path, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama_path))
    copy = tmp_path / "copy"
    shutil.copytree(tiny_llama_path, copy)
    cfg = EngineConfig(model="m")
    base = model_identity(cfg, tiny_llama_path, tok)
    assert model_identity(cfg, copy, tok).mismatch(base) is None  # another path, same checkpoint
    f = next(copy.glob("*.safetensors"))
    state = load_file(f)
    name = next(iter(state))
    state[name] = state[name] + 1e-3  # a fine-tune: same shapes, same sizes, other bytes
    save_file(state, f, metadata={"format": "pt"})
    assert "revision" in model_identity(cfg, copy, tok).mismatch(base)


def test_engine_exposes_its_identity(tiny_llama_path):
    from genpool.engine import LLM

    eng = LLM(str(tiny_llama_path), num_kv_blocks=32).llm_engine
    ident = eng.model_identity()
    assert ident.dtype == "float32" and ident.quantization is None
    assert ident == model_identity(eng.config, eng.model_path, eng.tokenizer)
