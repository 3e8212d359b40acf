"""AWQ checkpoints (AutoAWQ's "gemm" layout, Llama family): int4 weights with per-group zero points.

Per linear layer `<name>.qweight` int32 [K, N / 8], `<name>.qzeros` int32 [K / G, N / 8] and
`<name>.scales` fp16 [K / G, N]; W[k, n] = (q[k, n] - z[k / G, n]) * s[k / G, n] (K inputs, N
outputs, G the group size, 128 by default). Each int32 holds eight 4-bit values of consecutive
output columns in AWQ's interleaved order: nibble i is column 8c + AWQ_ORDER[i]. Loaded as a
kernels/qtensor.py QTensor [N, K] with scale s and offset -s * z, which is exact: s is an fp16, z
and q are 4-bit, so s * z and s * q are exact fp32 products and s * q - s * z = s * (q - z).
Norms and embeddings are plain tensors (fp16 in AWQ files), widened to the engine's dtype.
"""
from __future__ import annotations

from pathlib import Path

import torch

from genpool.kernels.qtensor import QTensor, pack_nibbles

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a packed int32 -> column offset AWQ_ORDER[i]
_PROJ = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
         "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C / 8] in AWQ order -> int32 [R, C] of 0..15 in column order."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nib = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF  # [R, C/8, 8]: nibble i
    out = torch.empty_like(nib)
    out[..., list(AWQ_ORDER)] = nib  # nibble i -> column offset AWQ_ORDER[i]
    return out.reshape(packed.shape[0], -1)


def pack_int4(ints: torch.Tensor) -> torch.Tensor:
    """The inverse of unpack_int4 (tests write AWQ checkpoints with it)."""
    r, c = ints.shape
    cols = ints.to(torch.int64).reshape(r, c // 8, 8)[..., list(AWQ_ORDER)]  # nibble i <- column AWQ_ORDER[i]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    packed = (cols << shifts).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # two's complement


def awq_qtensor(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, name: str = "") -> QTensor:
    k, n = qweight.shape[0], qweight.shape[1] * 8
    groups = scales.shape[0]
    if k % groups or scales.shape[1] != n or tuple(qzeros.shape) != (groups, n // 8):
        raise ValueError(f"{name}: AWQ shapes do not agree: qweight {tuple(qweight.shape)}, qzeros "
                         f"{tuple(qzeros.shape)}, scales {tuple(scales.shape)}")
    q = unpack_int4(qweight).t().contiguous()  # [N, K]
    s = scales.float().t().contiguous()  # [N, groups]
    z = unpack_int4(qzeros).float().t()
    return QTensor(pack_nibbles(q), s, (-s * z).contiguous(), 4, k // groups, (n, k), "awq")


def load_awq_model(path: str | Path, args, dtype: torch.dtype = torch.float32, device="cpu", kern=None):
    from safetensors.torch import load_file

    from genpool.engine.models.quant import build_model
    path = Path(path)
    state: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(f)))

    def weight(prefix: str):
        if f"{prefix}.qweight" in state:
            return awq_qtensor(state.pop(f"{prefix}.qweight"), state.pop(f"{prefix}.qzeros"),
                               state.pop(f"{prefix}.scales"), prefix)
        if f"{prefix}.weight" in state:
            return state.pop(f"{prefix}.weight").float()
        raise ValueError(f"{path}: AWQ checkpoint has no {prefix}.qweight (nor .weight)")

    layers = []
    for i in range(args.num_layers):
        p = f"model.layers.{i}."
        w = {c: weight(p + proj) for c, proj in _PROJ.items()}
        w["ln1"], w["ln2"] = state.pop(p + "input_layernorm.weight"), state.pop(p + "post_attention_layernorm.weight")
        for c in "qkv":
            b = state.pop(f"{p}self_attn.{c}_proj.bias", None)
            if b is not None:
                w[f"{c}_bias"] = b.float()
        layers.append(w)
    lm_head = weight("lm_head") if ("lm_head.qweight" in state or "lm_head.weight" in state) else None
    if lm_head is None and not args.tie_word_embeddings:
        raise ValueError(f"{path}: no lm_head and the config does not tie embeddings")
    model = build_model(args, layers, state.pop("model.embed_tokens.weight").float(),
                        state.pop("model.norm.weight"), lm_head, dtype, device, kern)
    left = [k for k in state if "rotary_emb" not in k]
    if left:
        raise ValueError(f"{path}: tensors the model has no place for: {left[:8]}")
    return model
