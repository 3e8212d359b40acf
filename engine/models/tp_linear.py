"""Tensor-parallel pieces of the Llama model (Megatron-style), used when tensor_parallel_size > 1.

One rank's model is the plain LlamaForCausalLM built with that rank's share of the heads, KV heads,
MLP columns and vocabulary (`TPShard.local_args`), plus three module swaps:
- o_proj and down_proj become `RowParallelLinear`: each rank multiplies its input columns, then
  one all-reduce sums the partial products (two all-reduces per layer in all);
- qkv and gate_up stay plain `Linear`s loaded with this rank's output columns (column-parallel:
  no communication); the fused [gate | up] keeps both halves' columns of this rank, so SwiGLU
  stays local;
- embed_tokens becomes `VocabParallelEmbedding` (rows of this rank's vocab slice, one all-reduce)
  and lm_head `VocabParallelHead` (columns of the same slice, gathered on rank 0 for the sampler).
KV heads: each rank keeps the KV heads its query heads read. When the ranks outnumber the KV heads
(vLLM's case: N a multiple of num_kv_heads), or more generally whenever a rank's query heads fall
into whole groups or within one group, a KV head is replicated on every rank that needs it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from genpool.engine.models.llama import Linear, LlamaForCausalLM, ModelArgs


@dataclass(frozen=True)
class TPShard:
    """What rank `rank` of `size` holds: global index ranges into the checkpoint's tensors."""
    rank: int
    size: int
    q_heads: range
    kv_heads: range
    inter: range
    vocab: range  # this rank's vocab rows (the last rank's may be short)
    vocab_per_rank: int  # rows every rank allocates (the short one pads with zeros)

    def local_args(self, args: ModelArgs) -> ModelArgs:
        return replace(args, num_heads=len(self.q_heads), num_kv_heads=len(self.kv_heads),
                       intermediate_size=len(self.inter), vocab_size=self.vocab_per_rank)


def _why_not(args: ModelArgs, size: int) -> str | None:
    """Why this model cannot be split over `size` ranks, or None when it can."""
    nh, nkv = args.num_heads, args.num_kv_heads
    if nh % size:
        return f"the {nh} attention heads do not split evenly over {size} ranks"
    if args.intermediate_size % size:
        return f"the MLP's {args.intermediate_size} columns do not split evenly over {size} ranks"
    if nh % nkv:
        return f"{nh} query heads do not form whole groups over {nkv} KV heads"
    group, per = nh // nkv, nh // size
    if per % group and group % per:  # a rank's query heads straddle KV groups unevenly
        return (f"each rank would hold {per} query heads, which neither cover whole groups of {group} "
                f"(one KV head each) nor fit in one, so KV heads can be neither split nor replicated evenly")
    return None


def plan_shard(args: ModelArgs, rank: int, size: int) -> TPShard:
    """Rank `rank`'s shard, or a ValueError naming the sizes this model can be split into."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"bad tensor-parallel rank {rank} of {size}")
    why = _why_not(args, size)
    if why:
        sizes = [n for n in range(1, 17) if _why_not(args, n) is None]
        raise ValueError(f"tensor_parallel_size={size} is not supported for this model: {why}; "
                         f"sizes that work (up to 16): {sizes}")
    nh, per = args.num_heads, args.num_heads // size
    group = nh // args.num_kv_heads
    q = range(rank * per, (rank + 1) * per)
    kv = range(q.start // group, (q.stop - 1) // group + 1)
    inter = args.intermediate_size // size
    vpr = math.ceil(args.vocab_size / size)
    return TPShard(rank, size, q, kv, range(rank * inter, (rank + 1) * inter),
                   range(min(rank * vpr, args.vocab_size), min((rank + 1) * vpr, args.vocab_size)), vpr)


class RowParallelLinear(Linear):
    """y = sum over ranks of x_rank @ W_rank: this rank's input columns, then one all-reduce."""

    def __init__(self, n_in: int, n_out: int, comm):
        super().__init__(n_in, n_out, bias=False)  # a bias would be added N times: Llama has none here
        self.comm = comm

    def forward(self, x):
        return self.comm.all_reduce(super().forward(x))


class VocabParallelEmbedding(nn.Module):
    """This rank's vocab rows; ids of other ranks' rows give zeros, and one all-reduce fills them in."""

    def __init__(self, shard: TPShard, hidden: int, comm):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shard.vocab_per_rank, hidden))
        self.start, self.stop = shard.vocab.start, shard.vocab.stop
        self.comm = comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.start) & (ids < self.stop)
        x = F.embedding((ids - self.start).clamp_(0, self.weight.shape[0] - 1), self.weight)
        x.masked_fill_(~mine.unsqueeze(-1), 0)
        return self.comm.all_reduce(x)


class VocabParallelHead(Linear):
    """Logits for this rank's vocab columns, gathered on rank 0 into [N, vocab] (other ranks get their
    own slice back, which nothing reads: only rank 0 samples)."""

    def __init__(self, hidden: int, shard: TPShard, vocab: int, comm):
        super().__init__(hidden, shard.vocab_per_rank)
        self.vocab, self.comm = vocab, comm

    def forward(self, x):
        local = super().forward(x).contiguous()
        parts = self.comm.gather_to_first(local)
        return local if parts is None else torch.cat(parts, dim=-1)[:, :self.vocab]


class TPLlamaForCausalLM(LlamaForCausalLM):
    """One rank's model. Pure-decode steps may still take the backend's one-call decoder stack
    (kernels/cpu/cpu_decode_layers.c): it calls back into `comm.all_reduce` after each layer's o_proj
    and down products, the same two all-reduces per layer as the module path."""

    comm = None  # set by tp_model

    def decode_stack_spec(self, kv_caches, max_pos: int):
        layers, final_norm, kw = super().decode_stack_spec(kv_caches, max_pos)
        return layers, final_norm, dict(kw, all_reduce=self.comm.all_reduce)


def tp_model(args: ModelArgs, shard: TPShard, comm, kern):
    """The rank's model on the meta device (load_shard fills it)."""
    local = shard.local_args(args)
    with torch.device("meta"):
        model = TPLlamaForCausalLM(local, kern)
        model.comm = comm
        for layer in model.model.layers:
            layer.self_attn.o_proj = RowParallelLinear(local.num_heads * args.head_dim, args.hidden_size, comm)
            layer.mlp.down_proj = RowParallelLinear(local.intermediate_size, args.hidden_size, comm)
        model.model.embed_tokens = VocabParallelEmbedding(shard, args.hidden_size, comm)
        model.lm_head = VocabParallelHead(args.hidden_size, shard, args.vocab_size, comm)
    # the rank's KV shape comes from its own heads; the engine checks prompts against the full vocab
    model.args = replace(local, vocab_size=args.vocab_size)
    return model
