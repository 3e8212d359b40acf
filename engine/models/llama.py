"""Llama-family decoder (Llama, SmolLM2, Mistral-style, Qwen2-style qkv bias), gpt-fast style.

The model runs on a flattened batch: T tokens from many sequences, no padding. Attention and
KV writes go through a kernel backend (kernels/) over the paged cache. HF checkpoints keep
q/k/v and gate/up as separate matrices; load hooks fuse them so each layer does two matmuls
fewer per step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from genpool.engine.attention_metadata import AttentionMetadata, SampledRows
from genpool.kernels import DecodeStack, KernelBackend


@dataclass
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: list[int] | None = None

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelArgs":
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        supported = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
        if arch not in supported:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(supported)}")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        if rope.get("rope_type", "default") not in ("default", "llama3"):
            raise ValueError(f"unsupported rope_type {rope.get('rope_type')!r}")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5), rope_theta=float(theta),
            rope_scaling=rope if rope.get("rope_type") == "llama3" else None,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            attention_bias=cfg.get("attention_bias", arch == "Qwen2ForCausalLM"),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=[eos] if isinstance(eos, int) else eos,
        )


def rope_cache(args: ModelArgs, max_pos: int) -> torch.Tensor:
    """[max_pos, head_dim] = [cos | sin] halves, computed in fp32 exactly as HF does."""
    d = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if args.rope_scaling:
        inv_freq = _llama3_scale(inv_freq, args.rope_scaling)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.int64).float(), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def _llama3_scale(inv_freq: torch.Tensor, rs: dict) -> torch.Tensor:
    factor, lo, hi = rs["factor"], rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
    old_len = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - lo) / (hi - lo)
    scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
    mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    is_mid = (wavelen <= old_len / lo) & (wavelen >= old_len / hi)
    return torch.where(is_mid, mid, scaled)


class Linear(nn.Module):
    """y = x @ W (+ bias). Loaded as weight_t [in, out] (decode-sized products ran 20-30% faster from
    that layout than from F.linear's [out, in] under MKL); `pack(kern)` then hands the weight to the
    kernel backend, which may keep its own layout (the CPU backend: 16-column panels for
    kernels/cpu/cpu_gemm.c, after which the loaded copy is dropped), and binds the layer to it."""

    def __init__(self, n_in: int, n_out: int, bias: bool = False):
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.empty(n_out)) if bias else None
        self.packed = None  # kern.pack_linear's result once packed
        self.kern: KernelBackend | None = None  # the backend that packed it
        self.qweight = None  # a kernels.qtensor.QTensor [out, in] instead of weight_t (engine/models/quant.py)
        self._register_load_state_dict_pre_hook(self._transpose)

    def _transpose(self, state, prefix, *args):
        # Runs after the parent's fusing hooks (parents load first), so sees fused weights.
        w = state.pop(f"{prefix}weight", None)
        if w is not None:
            state[f"{prefix}weight_t"] = w.t().contiguous()

    def pack(self, kern: KernelBackend) -> None:
        self.kern = kern
        self.packed = kern.pack_linear(self.weight_t if self.qweight is None else self.qweight, self.bias)
        if not kern.linear_keeps_weight:
            self.weight_t = self.qweight = None  # the packed copy is the weight now: do not hold it twice

    def packed_weight(self):
        """The weight as the backend packed it (what kern.linear and kernels like it take)."""
        if self.packed is None:
            raise RuntimeError("Linear.pack(kern) must run before forward")
        return self.packed

    def forward(self, x):
        # x [T, in] -> [T, out]
        w = self.packed_weight()  # a clear error before pack(kern)
        return self.kern.linear(x, w)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, kern: KernelBackend):
        super().__init__()
        self.kern = kern
        self.nh, self.nkv, self.hd = args.num_heads, args.num_kv_heads, args.head_dim
        self.qkv = Linear(args.hidden_size, (self.nh + 2 * self.nkv) * self.hd, bias=args.attention_bias)
        self.o_proj = Linear(self.nh * self.hd, args.hidden_size)
        self.scale = self.hd ** -0.5
        self._register_load_state_dict_pre_hook(self._fuse_qkv)

    def _fuse_qkv(self, state, prefix, *args):
        for kind in ("weight", "bias"):
            names = [f"{prefix}{p}_proj.{kind}" for p in "qkv"]
            if names[0] in state:
                state[f"{prefix}qkv.{kind}"] = torch.cat([state.pop(n) for n in names])

    def forward(self, x, positions, kv, meta: AttentionMetadata, keep: SampledRows | None = None):
        # x: [T, H] -> qkv: [T, (nh + 2 nkv) * hd] -> [T, H], or [R, H] for the R rows of `keep`
        kern = self.kern
        q, k, v = self.qkv(x).split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], dim=-1)
        q, k = kern.rotary(q.view(-1, self.nh, self.hd), k.view(-1, self.nkv, self.hd), positions, meta.rope)
        v = v.view(-1, self.nkv, self.hd)
        k_cache, v_cache = kv
        kern.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)  # every row's K/V: later steps read them
        if keep is not None:  # only these rows' outputs are wanted: one query each
            if keep.rows.numel() == 0:  # none at all: this layer's K/V were all it owed
                return x.new_empty(0, x.shape[1])
            q, meta = q.index_select(0, keep.rows), keep
        o = kern.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                 meta.seq_lens, self.scale)  # [T or R, nh, hd]
        return self.o_proj(o.reshape(-1, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, kern: KernelBackend):
        super().__init__()
        self.kern = kern
        self.gate_up = Linear(args.hidden_size, 2 * args.intermediate_size)
        self.down_proj = Linear(args.intermediate_size, args.hidden_size)
        self._register_load_state_dict_pre_hook(self._fuse_gate_up)

    def _fuse_gate_up(self, state, prefix, *args):
        g, u = f"{prefix}gate_proj.weight", f"{prefix}up_proj.weight"
        if g in state:
            state[f"{prefix}gate_up.weight"] = torch.cat([state.pop(g), state.pop(u)])

    def forward(self, x):
        # x [T, H] -> silu(gate) * up [T, I] (one kernel: the backend may fuse the product and SwiGLU) -> [T, H]
        return self.down_proj(self.kern.gate_up_silu(x, self.gate_up.packed_weight()))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kern: KernelBackend):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kern = kern

    def forward(self, x, residual):
        return self.kern.rms_norm(x, self.weight, self.eps, residual)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, kern: KernelBackend):
        super().__init__()
        self.self_attn = Attention(args, kern)
        self.mlp = MLP(args, kern)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, kern)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, kern)

    def forward(self, x, residual, positions, kv, meta: AttentionMetadata, keep: SampledRows | None = None):
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, kv, meta, keep)
        if keep is not None:
            if h.shape[0] == 0:
                return h, h
            residual = residual.index_select(0, keep.rows)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs, kern: KernelBackend):
        super().__init__()
        # _weight: no random init (every loader assigns the weight; on the meta device the init
        # would import torch._dynamo, and with it triton: ~100 MB of a CPU worker's RSS)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size,
                                         _weight=torch.empty(args.vocab_size, args.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(args, kern) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, kern)


class LlamaForCausalLM(nn.Module):
    def __init__(self, args: ModelArgs, kern: KernelBackend):
        super().__init__()
        self.args = args
        self.kern = kern
        self.model = LlamaModel(args, kern)
        self.lm_head = Linear(args.hidden_size, args.vocab_size)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata,
                decode_stack: DecodeStack | None = None):
        # input_ids, positions: [T] -> hidden [T, H] (final-normed); [R, H] when meta.keep names
        # R rows: the last layer's attention, o_proj and MLP then run on those rows alone (a
        # prompt's other rows only need that layer's K/V; ~3% of a prefill step's GEMM work)
        x = self.model.embed_tokens(input_ids)
        if meta.decode_only and decode_stack is not None:  # all layers in one call: same kernels, same order
            return decode_stack(x, positions, meta.rope, meta.slot_mapping, meta.block_tables, meta.seq_lens)
        residual, keep, last = None, meta.keep, len(self.model.layers) - 1
        for i, (layer, kv) in enumerate(zip(self.model.layers, kv_caches)):
            x, residual = layer(x, residual, positions, kv, meta, keep if i == last else None)
        if x.shape[0] == 0:  # no row sampled this step (a prompt chunk ending mid-prompt)
            return x
        x, _ = self.model.norm(x, residual)
        return x

    def decode_stack_spec(self, kv_caches, max_pos: int) -> tuple[list[dict], torch.Tensor, dict]:
        """What a backend's decode_layers builder takes: per layer its norm weights, packed weights
        and KV caches; the final norm's weight; the shapes, eps, attention scale and rope length."""
        layers = [dict(ln1=l.input_layernorm.weight, ln2=l.post_attention_layernorm.weight,
                       qkv=l.self_attn.qkv.packed_weight(), o=l.self_attn.o_proj.packed_weight(),
                       gate_up=l.mlp.gate_up.packed_weight(), down=l.mlp.down_proj.packed_weight(),
                       k_cache=kv[0], v_cache=kv[1]) for l, kv in zip(self.model.layers, kv_caches)]
        a = self.args
        return layers, self.model.norm.weight, dict(
            num_heads=a.num_heads, num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, eps=self.model.norm.eps,
            scale=self.model.layers[0].self_attn.scale, max_pos=max_pos)

    def build_decode_stack(self, kv_caches, max_pos: int) -> DecodeStack | None:
        """The backend's one-call decoder stack for pure-decode steps over these KV caches (built
        once, where the caches are made; None where the backend has none or cannot run these
        layers): in Python each decode step's ~300 small kernel launches cost more than the work of
        many of them (~15% of the CPU decode steps' time)."""
        norms = [n for l in self.model.layers for n in (l.input_layernorm, l.post_attention_layernorm)]
        if any(n.eps != self.model.norm.eps for n in norms):  # the stack takes one eps
            return None
        layers, final_norm, kw = self.decode_stack_spec(kv_caches, max_pos)
        return self.kern.decode_layers(layers, final_norm, **kw)

    def compute_logits(self, hidden):
        # hidden [N, H] -> logits [N, V] in fp32 for the sampler
        return self.lm_head(hidden).float()

    def pack_linears(self) -> None:
        """Give every linear layer's weight to the kernel backend's layout (once, after loading).
        A quantized embedding tied to the lm_head (engine/models/quant.py QuantEmbedding over the
        lm_head's QTensor) then looks its rows up in the lm_head's packed weight where that can
        dequantize rows (kernels/cpu/qgemm.py QPackedWeight), so the table is held once, packed."""
        embed, head_q = self.model.embed_tokens, self.lm_head.qweight
        for m in self.modules():
            if isinstance(m, Linear):
                m.pack(self.kern)
        packed = self.lm_head.packed
        if (head_q is not None and getattr(embed, "qweight", None) is head_q
                and callable(getattr(packed, "dequantize", None))):
            embed.qweight = packed
