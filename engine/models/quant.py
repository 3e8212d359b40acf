"""Quantized weights for the model: int8 at load, and the module pieces quantized checkpoints need.

Every format lands in one layout, kernels/qtensor.py's QTensor (W = scale * q + offset per group):
- int8 at load (`quantize_int8`): q int8, one scale per output channel (group = K), no offset;
- GGUF Q8_0: q int8, group 32, no offset; Q4_0: q 0..15, offset -8 * scale; Q4_1: q 0..15,
  offset = the block's min (engine/models/gguf_loader.py);
- AWQ: q 0..15, group 128, offset -scale * zero (engine/models/awq.py).
For 4-bit GGUF and AWQ, scale * q and scale * zero are exact fp32 products of an fp16 scale and a
4-bit integer, so a dequantized weight is bit-identical to the format's own dequantization.
"""
from __future__ import annotations

import torch

from genpool.engine.config import QUANTIZATIONS
from genpool.kernels.qtensor import QTensor
from genpool.kernels.qtensor import cat as qcat


def quantize_int8(w: torch.Tensor) -> QTensor:
    """W [N, K] (fp32/bf16/fp16) -> int8 per output channel, symmetric: scale = max|row| / 127."""
    w = w.detach().float()
    scale = w.abs().amax(dim=1, keepdim=True) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: q = 0
    q = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)
    return QTensor(q.contiguous(), scale.contiguous(), None, 8, w.shape[1], tuple(w.shape), "int8")


class QuantEmbedding(torch.nn.Module):
    """nn.Embedding over a QTensor [vocab, hidden]: looked-up rows dequantized. Tied to the lm_head,
    it reads the lm_head's QTensor and, once the backend has packed that, the packed weight
    (anything with QTensor's dequantize(rows); engine/models/llama.py pack_linears), so the table is
    held once."""

    def __init__(self, weight: QTensor, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.qweight, self.dtype = weight, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight.dequantize(ids.reshape(-1).long()).to(self.dtype).reshape(*ids.shape, -1)


Weight = QTensor | torch.Tensor  # a linear weight [N, K]: quantized, or plain (fp32/bf16/fp16)


def _fuse(parts: list[Weight]) -> Weight:
    """The model's fused q|k|v and gate|up: outputs side by side. Parts of one format stay quantized;
    a mix (a file keeping one of them in F16, say) is dequantized, as no one layout holds both."""
    if all(isinstance(p, QTensor) for p in parts):
        try:
            return qcat(parts)
        except ValueError:
            pass
    return torch.cat([p.dequantize() if isinstance(p, QTensor) else p.float() for p in parts])


def set_weight(linear, w: Weight, dtype: torch.dtype, bias: torch.Tensor | None = None) -> None:
    """Give a model Linear its weight: a QTensor is kept as is (the backend packs it), a plain one
    is stored transposed as the module expects."""
    if isinstance(w, QTensor):
        linear.qweight, linear.weight_t = w, None
    else:
        linear.weight_t = torch.nn.Parameter(w.to(dtype).t().contiguous(), requires_grad=False)
    if bias is not None:
        linear.bias = torch.nn.Parameter(bias.to(dtype), requires_grad=False)


def build_model(args, layers: list[dict[str, Weight]], embed: Weight, norm: torch.Tensor,
                lm_head: Weight | None, dtype: torch.dtype, device, kern=None):
    """A LlamaForCausalLM from per-layer weights in HF's names (q, k, v, o, gate, up, down: [N, K];
    ln1, ln2: norm weights; q_bias, k_bias, v_bias where the model has them). lm_head None: tied."""
    from genpool.engine.models.llama import LlamaForCausalLM
    with torch.device("meta"):
        model = LlamaForCausalLM(args, kern)
    p = lambda t: torch.nn.Parameter(t.to(dtype), requires_grad=False)  # noqa: E731
    for layer, w in zip(model.model.layers, layers):
        layer.input_layernorm.weight, layer.post_attention_layernorm.weight = p(w["ln1"]), p(w["ln2"])
        bias = torch.cat([w[f"{c}_bias"] for c in "qkv"]) if "q_bias" in w else None
        set_weight(layer.self_attn.qkv, _fuse([w["q"], w["k"], w["v"]]), dtype, bias)
        set_weight(layer.self_attn.o_proj, w["o"], dtype)
        set_weight(layer.mlp.gate_up, _fuse([w["gate"], w["up"]]), dtype)
        set_weight(layer.mlp.down_proj, w["down"], dtype)
    model.model.norm.weight = p(norm)
    if isinstance(embed, QTensor):
        model.model.embed_tokens = QuantEmbedding(embed, dtype)
    else:
        model.model.embed_tokens = torch.nn.Embedding.from_pretrained(embed.to(dtype), freeze=True)
    set_weight(model.lm_head, embed if lm_head is None else lm_head, dtype)
    left = [n for n, t in model.named_parameters() if t.is_meta]
    if left:
        raise ValueError(f"quantized checkpoint left weights unset: {left[:8]}")
    _move_qtensors(model, torch.device(device))
    return model.to(device).eval()


def _move_qtensors(model, device: torch.device) -> None:
    """QTensors are not parameters, so model.to() does not move them; a shared one stays shared."""
    from genpool.engine.models.llama import Linear
    moved: dict[int, QTensor] = {}
    for m in model.modules():
        if isinstance(m, (Linear, QuantEmbedding)) and m.qweight is not None and m.qweight.q.device != device:
            m.qweight = moved.setdefault(id(m.qweight), m.qweight.to(device))


def quantize_model(model, mode: str) -> None:
    """Quantize every linear weight of a loaded model in place (mode "int8": per output channel);
    a tied embedding shares the lm_head's int8 table."""
    from genpool.engine.models.llama import Linear
    if mode != "int8":
        raise ValueError(f"quantize at load: only 'int8', got {mode!r}")
    tied = model.args.tie_word_embeddings and isinstance(model.model.embed_tokens, torch.nn.Embedding)
    for m in model.modules():
        if isinstance(m, Linear) and m.weight_t is not None:
            set_weight(m, quantize_int8(m.weight_t.t()), m.weight_t.dtype)
    if tied:
        dtype = model.model.embed_tokens.weight.dtype
        model.model.embed_tokens = QuantEmbedding(model.lm_head.qweight, dtype)


def checkpoint_quantization(cfg: dict, asked: str | None) -> str | None:
    """What to load: what the user asked for, checked against what the checkpoint is (an AWQ
    checkpoint says so in config.json's quantization_config and loads as AWQ unasked)."""
    method = (cfg.get("quantization_config") or {}).get("quant_method")
    if asked is not None and asked not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {asked!r}")
    if method is None:
        if asked == "awq":
            raise ValueError("quantization 'awq' asked for, but config.json has no AWQ quantization_config")
        return asked
    if method != "awq":
        raise ValueError(f"checkpoint quantization {method!r} is not supported (supported: awq)")
    if asked not in (None, "awq"):
        raise ValueError(f"the checkpoint is AWQ-quantized; quantization {asked!r} cannot apply to it")
    return "awq"
