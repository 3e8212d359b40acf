"""Native GGUF weights (Q8_0, Q4_0, Q4_1; F32/F16/BF16 tensors as plain weights), no fp32 unpack.

The `gguf` package reads the file (memory-mapped); each quantized tensor's blocks are re-laid as a
kernels/qtensor.py QTensor, whose dequantization is bit-identical to gguf's own (tests check it).
llama.cpp's converter permutes the rows of attn_q / attn_k for its rotary layout; the rows are
permuted back here (as transformers' GGUF loader does), whole rows, so quantized blocks (which run
along the input dimension) move intact.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from genpool.kernels.qtensor import QTensor, pack_nibbles

# GGML type name -> (bits, block elements, bytes per block)
QUANT_TYPES = {"Q8_0": (8, 32, 34), "Q4_0": (4, 32, 18), "Q4_1": (4, 32, 20)}
PLAIN_TYPES = ("F32", "F16", "BF16")


def find_gguf(model_path: str | Path) -> Path:
    """The GGUF file for a model: the path itself (a .gguf file), the only .gguf in the directory,
    or the registry model's shipped GGUF (engine/models/registry.py gguf_path)."""
    p = Path(model_path)
    if p.is_file() and p.suffix == ".gguf":
        return p
    found = sorted(p.glob("*.gguf")) if p.is_dir() else []
    if len(found) == 1:
        return found[0]
    if len(found) > 1:
        raise ValueError(f"{p} holds {len(found)} .gguf files; name one: {[f.name for f in found]}")
    from genpool.engine.models.registry import gguf_path
    return gguf_path(p.name)


def _blocks_to_qtensor(name: str, ttype: str, data: np.ndarray, n: int, k: int) -> QTensor:
    bits, per, nbytes = QUANT_TYPES[ttype]
    if k % per:
        raise ValueError(f"{name}: {k} inputs are not whole {per}-element blocks")
    blocks = np.ascontiguousarray(data).reshape(n, k // per, nbytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [n, k / 32]
    if ttype == "Q8_0":
        q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(n, k))
        return QTensor(q, torch.from_numpy(d), None, 8, per, (n, k), ttype)
    start = 4 if ttype == "Q4_1" else 2
    qs = blocks[..., start:]  # [n, blocks, 16]: element i low nibble of byte i, i + 16 the high one
    ints = np.concatenate((qs & 0x0F, qs >> 4), axis=-1).reshape(n, k)
    if ttype == "Q4_1":
        off = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:  # Q4_0: d * (q - 8) = d * q - 8 d, exactly (d has 11 significant bits, q 4)
        off = -8.0 * d
    return QTensor(pack_nibbles(torch.from_numpy(ints)), torch.from_numpy(d), torch.from_numpy(off), 4, per,
                   (n, k), ttype)


def _plain(t) -> torch.Tensor:
    from gguf import dequantize
    arr = dequantize(t.data, t.tensor_type)  # F32/F16/BF16 -> float32 (a copy for the 16-bit types)
    return torch.from_numpy(np.array(arr, dtype=np.float32)).reshape([int(s) for s in reversed(t.shape)])


def read_tensors(path: Path) -> tuple[dict, dict[str, QTensor | torch.Tensor]]:
    """(metadata, tensors): quantized 2-D tensors as QTensor [N, K], the rest as fp32 tensors."""
    from gguf import GGUFReader
    reader = GGUFReader(str(path))
    meta = {}
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer.ggml."):
            try:
                meta[key] = field.contents()
            except (ValueError, IndexError, TypeError):
                pass
    out: dict[str, QTensor | torch.Tensor] = {}
    for t in reader.tensors:
        ttype = t.tensor_type.name
        if ttype in QUANT_TYPES and len(t.shape) == 2:
            k, n = int(t.shape[0]), int(t.shape[1])  # GGUF lists dims fastest first
            out[t.name] = _blocks_to_qtensor(t.name, ttype, t.data, n, k)
        elif ttype in PLAIN_TYPES:
            out[t.name] = _plain(t)
        else:
            raise ValueError(f"{path}: tensor {t.name} is {ttype}; supported: "
                             f"{', '.join((*QUANT_TYPES, *PLAIN_TYPES))}")
    return meta, out


def unpermute_rows(n: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation (per head: interleaved rotary halves)."""
    half = n // heads // 2
    return torch.arange(n).reshape(heads, half, 2).transpose(1, 2).reshape(n)


def check_args(meta: dict, args) -> None:
    """Refuse a GGUF whose shape is not the config's (a file from another model)."""
    want = {"llama.block_count": args.num_layers, "llama.embedding_length": args.hidden_size,
            "llama.feed_forward_length": args.intermediate_size, "llama.attention.head_count": args.num_heads,
            "llama.attention.head_count_kv": args.num_kv_heads}
    bad = {k: (meta.get(k), v) for k, v in want.items() if k in meta and int(meta[k]) != v}
    if meta.get("general.architecture", "llama") != "llama" or bad:
        raise ValueError(f"GGUF does not match the model config: architecture "
                         f"{meta.get('general.architecture')!r}, (file, config) {bad}")


_LAYER_NAMES = {"ln1": "attn_norm", "ln2": "ffn_norm", "q": "attn_q", "k": "attn_k", "v": "attn_v",
                "o": "attn_output", "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"}


def _unpermute(w, heads: int):
    from genpool.kernels.qtensor import permute_rows
    idx = unpermute_rows(w.shape[0], heads)
    return permute_rows(w, idx) if isinstance(w, QTensor) else w.index_select(0, idx)


def load_gguf_model(model_path: str | Path, args, dtype: torch.dtype = torch.float32, device="cpu",
                    kern=None):
    """The model with its linear weights (and a quantized embedding table) as the GGUF stores them."""
    from genpool.engine.models.quant import build_model
    path = find_gguf(model_path)
    meta, t = read_tensors(path)
    check_args(meta, args)
    layers = []
    for i in range(args.num_layers):
        w = {ours: t.pop(f"blk.{i}.{theirs}.weight") for ours, theirs in _LAYER_NAMES.items()}
        w["q"], w["k"] = _unpermute(w["q"], args.num_heads), _unpermute(w["k"], args.num_kv_heads)
        for c, theirs in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v")):
            b = t.pop(f"blk.{i}.{theirs}.bias", None)
            if b is not None:
                heads = {"q": args.num_heads, "k": args.num_kv_heads}.get(c)
                w[f"{c}_bias"] = _unpermute(b.reshape(-1, 1), heads).reshape(-1) if heads else b
        layers.append(w)
    lm_head = t.pop("output.weight", None)
    if lm_head is None and not args.tie_word_embeddings:
        raise ValueError(f"{path}: no output.weight and the config does not tie embeddings")
    model = build_model(args, layers, t.pop("token_embd.weight"), t.pop("output_norm.weight"), lm_head,
                        dtype, device, kern)
    left = [n for n in t if "rope" not in n]
    if left:
        raise ValueError(f"{path}: tensors the model has no place for: {left[:8]}")
    return model
