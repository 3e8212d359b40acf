"""Helpers for the tensor-parallel tests: tiny checkpoints with chosen head counts, rank pids."""
from __future__ import annotations

from pathlib import Path

from tests.tiny_tokenizer import VOCAB_SIZE, write_tiny_tokenizer


def write_tiny(out: Path, heads: int, kv_heads: int, inter: int = 192, layers: int = 2,
               context: int = 2048, tied: bool = True, head_dim: int = 16) -> Path:
    """A random Llama (the tiny tokenizer, tests/tiny_tokenizer.py) with `heads` query heads of `head_dim` and `kv_heads` KV heads."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=head_dim * heads, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=context,
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2, initializer_range=0.1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=tied)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.float32).eval().save_pretrained(out, safe_serialization=True)
    write_tiny_tokenizer(out)
    return out


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid` (Linux /proc), e.g. a worker's tensor-parallel ranks."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except FileNotFoundError:
        return []
    return [int(p) for p in text.split()]


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def rank_pids(pid: int) -> list[int]:
    """The tensor-parallel ranks among pid's children (multiprocessing's resource tracker is not one)."""
    ranks = []
    for c in child_pids(pid):
        try:
            if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes():
                ranks.append(c)
        except FileNotFoundError:
            pass
    return ranks
