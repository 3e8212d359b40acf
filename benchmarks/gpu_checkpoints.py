"""Random-weight Llama checkpoints built on the device, with an offline word-level tokenizer.

A borrowed GPU machine has no network: gpu_check.sh builds what it measures. The shapes are real
ones (SmolLM2-135M's, Llama-3.2-1B's with its llama3 rope scaling); "tiny" ones are for the CPU
smoke run. Random weights cannot judge text, only speed and backend parity, which is all we need.
"""
from __future__ import annotations

from pathlib import Path

import torch


def _shape(vocab: int, hidden: int, inter: int, layers: int, heads: int, kv_heads: int, rope: dict) -> dict:
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                rope_parameters=rope)


def _llama3_rope(theta: float, factor: float, original_len: int) -> dict:
    return {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": original_len}


SHAPES = {
    "smollm2-shape": _shape(49152, 576, 1536, 30, 9, 3, {"rope_type": "default", "rope_theta": 100000.0}),
    "llama-1b-shape": _shape(128256, 2048, 8192, 16, 32, 8, _llama3_rope(500000.0, 32.0, 8192)),
    "tiny-a": _shape(512, 64, 128, 2, 4, 2, {"rope_type": "default", "rope_theta": 10000.0}),
    "tiny-b": _shape(384, 64, 96, 2, 4, 1, _llama3_rope(500000.0, 8.0, 256)),
}
SMOKE = ("tiny-a", "tiny-b")
FULL = ("smollm2-shape", "llama-1b-shape")


def write_tokenizer(out: Path, vocab_size: int) -> None:
    """A word-level tokenizer over "<t0>".."<tN>" (bos <t1>, eos <t2>): enough for the engine's
    detokenizer; the checks send token ids, never text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<t{i}>": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<t0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<t0>", bos_token="<t1>",
                            eos_token="<t2>").save_pretrained(str(out))


def build(name: str, out_dir: Path, device: str, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Random weights (seeded) in shape `name`, made on `device`, saved as safetensors in `dtype`."""
    import transformers

    out = Path(out_dir) / name
    if (out / "config.json").is_file():
        return out
    cfg = transformers.LlamaConfig(max_position_embeddings=8192, rms_norm_eps=1e-5, bos_token_id=1,
                                   eos_token_id=2, tie_word_embeddings=True, initializer_range=0.05,
                                   attention_bias=False, **SHAPES[name])
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg).to(dtype).eval()
    model.save_pretrained(str(out), safe_serialization=True)
    write_tokenizer(out, cfg.vocab_size)
    del model
    return out
