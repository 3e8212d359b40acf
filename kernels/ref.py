"""Torch reference implementations of the kernel contract (docs/design.md).

These are the ground truth the Triton kernels are tested against, and the path the engine
uses on the CPU. They favour few large torch ops over Python loops: decode rows (one query
token each) are attended in one batched SDPA call; prefill chunks go one sequence at a time.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from genpool.kernels import kvq
from genpool.kernels.qtensor import QTensor


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter k/v [T, Hkv, D] into the paged caches at flat slots; slot -1 is skipped."""
    k_flat = k_cache.view(-1, *k_cache.shape[2:])  # [num_blocks*bs, Hkv, D]
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    slots = slot_mapping.to(torch.long)
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    k_flat.index_copy_(0, slots, _stored(k, k_cache.dtype))
    v_flat.index_copy_(0, slots, _stored(v, v_cache.dtype))


def _stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows as the cache holds them: cast, or quantized for an int8 cache (kernels/kvq.py)."""
    return kvq.quantize(x) if dtype == torch.int8 else x.to(dtype)


def _gather(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """[num_blocks, bs, Hkv, D] + block ids -> [length, Hkv, D] (a copy)."""
    bs = cache.shape[1]
    nb = (length + bs - 1) // bs
    # index_select, not cache[idx]: advanced indexing on CPU is ~1000x slower here.
    return cache.index_select(0, table[:nb].to(torch.long)).reshape(nb * bs, *cache.shape[2:])[:length]


DECODE_GROUP = 16  # decode rows per padded SDPA call, after sorting by length


def _decode_rows(q, k_cache, v_cache, tables, lens, scale):
    """q [B, Hq, D], all rows one query token. Rows are sorted by kv length and attended in
    groups so that a short sequence is not padded to the longest one in the batch."""
    if q.shape[0] <= DECODE_GROUP:
        return _decode_group(q, k_cache, v_cache, tables, lens, scale)
    order = torch.argsort(lens)
    out = torch.empty_like(q)
    for part in order.split(DECODE_GROUP):
        res = _decode_group(q.index_select(0, part), k_cache, v_cache, tables.index_select(0, part),
                            lens.index_select(0, part), scale)
        out.index_copy_(0, part, res)
    return out


def _decode_group(q, k_cache, v_cache, tables, lens, scale):
    """One padded SDPA over the gathered blocks of a group of decode rows."""
    bs = k_cache.shape[1]
    max_len = int(lens.max())
    nb = (max_len + bs - 1) // bs
    idx = tables[:, :nb].to(torch.long).reshape(-1)
    shape = (lens.shape[0], nb * bs, *k_cache.shape[2:])
    # [B, Hkv, nb*bs, D]; a bf16 or int8 cache under fp32 q (kv_cache_dtype) widened to q's dtype
    k = kvq.widen(k_cache.index_select(0, idx).view(shape), q.dtype).transpose(1, 2)
    v = kvq.widen(v_cache.index_select(0, idx).view(shape), q.dtype).transpose(1, 2)
    pos = torch.arange(nb * bs, device=q.device)
    mask = (pos[None, :] < lens[:, None].to(q.device))[:, None, None, :]  # [B,1,1,S]
    if q.dtype != torch.float32:
        return _decode_matmul(q, k, v, mask, scale)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=k.shape[1] != q.shape[1])
    return out.squeeze(2)  # [B, Hq, D]


def _decode_matmul(q, k, v, mask, scale):
    """Explicit GQA attention for one query token; CPU SDPA is ~3x slower than this in bf16.
    q [B, Hq, D], k/v [B, Hkv, S, D], mask [B, 1, 1, S]; softmax in fp32."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.view(b, hkv, hq // hkv, d)  # query heads grouped under their kv head
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [B, Hkv, G, S]
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(b, hq, d)


def _prefill_seq(q, k_cache, v_cache, table, kv_len, scale):
    """q [L, Hq, D]: the last L positions of a kv_len-token sequence, causal."""
    q_len = q.shape[0]
    # 4-D inputs: CPU SDPA takes its fused flash path only for [B, H, L, D] (3-D is ~4x slower).
    k = kvq.widen(_gather(k_cache, table, kv_len), q.dtype).transpose(0, 1)[None]  # [1, Hkv, S, D]
    v = kvq.widen(_gather(v_cache, table, kv_len), q.dtype).transpose(0, 1)[None]
    gqa = k.shape[1] != q.shape[1]
    qh = q.transpose(0, 1)[None]  # [1, Hq, L, D]
    if q_len == kv_len:
        out = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        # Query j sits at absolute position kv_len - q_len + j and sees keys up to there.
        qpos = torch.arange(kv_len - q_len, kv_len, device=q.device)
        mask = torch.arange(kv_len, device=q.device)[None, :] <= qpos[:, None]
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention for a flattened batch over the paged cache. q [T, Hq, D] -> [T, Hq, D]."""
    return mixed_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, _decode_rows)


def prefill_rows(q, k_cache, v_cache, tables, q_starts, q_lens, kv_lens, scale, out) -> None:
    """Prefill chunks one sequence at a time through SDPA: sequence i's rows q[q_starts[i] : +
    q_lens[i]] are the last q_lens[i] of its kv_lens[i] positions; writes those rows of out."""
    for i, (a, n, kv) in enumerate(zip(q_starts, q_lens, kv_lens)):
        out[a:a + n] = _prefill_seq(q[a:a + n], k_cache, v_cache, tables[i], kv, scale)


def mixed_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, decode_rows,
                    prefill=prefill_rows):
    """paged_attention with the decode rows (one query token each) handed to `decode_rows(q, k_cache,
    v_cache, tables, lens, scale)` and the prefill chunks to `prefill` (signature of prefill_rows)."""
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    q_lens = [b - a for a, b in zip(starts[:-1], starts[1:])]
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    if len(decode) == len(q_lens):  # pure decode step: rows are already in order
        return decode_rows(q, k_cache, v_cache, block_tables, seq_lens, scale)
    if decode:
        rows = torch.tensor([starts[i] for i in decode], device=q.device)
        sel = torch.tensor(decode, device=q.device)
        res = decode_rows(q.index_select(0, rows), k_cache, v_cache, block_tables.index_select(0, sel),
                          seq_lens.index_select(0, sel), scale)
        out.index_copy_(0, rows, res)
    pre = [i for i, n in enumerate(q_lens) if n > 1]
    lens = seq_lens.tolist()
    tables = block_tables.index_select(0, torch.tensor(pre, device=q.device))
    prefill(q, k_cache, v_cache, tables, [starts[i] for i in pre], [q_lens[i] for i in pre],
            [lens[i] for i in pre], scale, out)
    return out


def pack_linear(weight_t, bias: torch.Tensor | None = None) -> tuple:
    """The reference keeps the loaded layout: W [in, out] (contiguous) and the bias; a quantized
    weight (kernels/qtensor.py QTensor [out, in]) is dequantized to that layout."""
    if isinstance(weight_t, QTensor):
        dtype = torch.float32 if bias is None else bias.dtype
        weight_t = weight_t.dequantize().t().contiguous().to(dtype)
    return weight_t, bias


def linear(x: torch.Tensor, w: tuple) -> torch.Tensor:
    """x [T, in] @ W [in, out] (+ bias) -> [T, out]; w from pack_linear."""
    weight_t, bias = w
    if weight_t.dtype != x.dtype:  # a dequantized weight (fp32) under bf16/fp16 activations
        weight_t, bias = weight_t.to(x.dtype), None if bias is None else bias.to(x.dtype)
    return x @ weight_t if bias is None else torch.addmm(bias, x, weight_t)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused (residual add +) RMSNorm, computed in fp32 like HF Llama, cast back before the weight."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype), x


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU over a fused gate_up output: x [T, 2I] = [gate | up] -> silu(gate) * up [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gate_up_silu(x: torch.Tensor, w: tuple) -> torch.Tensor:
    """The MLP's first half: x [T, H] @ [gate | up] (pack_linear of the fused [H, 2I] weight) ->
    silu(gate) * up [T, I]. Backends may fuse the two; this is the two steps."""
    return silu_and_mul(linear(x, w))


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
           cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox / HF rotate_half rotary embedding; cos_sin [max_pos, D] = [cos | sin] halves."""
    cs = cos_sin.index_select(0, positions.to(torch.long))  # [T, D]
    half = cs.shape[-1] // 2
    cos, sin = cs[:, None, :half], cs[:, None, half:]  # [T, 1, D/2]

    def rot(x):
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rot(q), rot(k)
