"""Unified Triton paged attention for a flattened batch of decode rows and prefill chunks.

One program handles one query tile of one sequence for ONE kv head, with every query head of
that kv head's GQA group stacked into the tile's rows: K/V of a page is loaded once and used by
all heads sharing it. Rows are laid out token-major: row r is query token r // GROUP_PAD, head
kv_head * group + r % GROUP_PAD, so a tile covers BLOCK_M // GROUP_PAD query tokens.

The launcher never reads device tensors (no host sync): the grid is an upper bound on the number
of tiles computed from shapes alone, and each program finds its sequence by binary search over
`query_start_loc` (sequence i owns tiles starting at query_start_loc[i] // BLOCK_Q + i; that
numbering gives every sequence at least cdiv(q_len, BLOCK_Q) tiles, surplus ones exit at once).
"""
import os

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _find_sequence(query_start_loc_ptr, tile_id, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest i in [0, num_seqs) whose first tile (qsl[i] // BLOCK_Q + i) is <= tile_id."""
    # Typed so the loop-carried values stay int32 even when num_seqs is specialised to 1.
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        ok = first_tile <= tile_id
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    num_seqs, scale_log2,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
):
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)

    seq = _find_sequence(query_start_loc_ptr, tile_id, num_seqs, BLOCK_Q)
    seq_q_start = tl.load(query_start_loc_ptr + seq)
    seq_q_end = tl.load(query_start_loc_ptr + seq + 1)
    tile_q_start = seq_q_start + (tile_id - (seq_q_start // BLOCK_Q + seq)) * BLOCK_Q
    if tile_q_start >= seq_q_end:
        return  # surplus tile of the upper-bound grid
    seq_len = tl.load(seq_lens_ptr + seq)
    # Query token t of the sequence sits at kv position context_len + t (its last q_len tokens).
    context_len = seq_len - (seq_q_end - seq_q_start)

    rows = tl.arange(0, BLOCK_M)
    token = tile_q_start + rows // GROUP_PAD
    head_in_group = rows % GROUP_PAD
    row_valid = (token < seq_q_end) & (head_in_group < GROUP)
    q_pos = context_len + (token - seq_q_start)
    head = kv_head * GROUP + head_in_group
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM

    q_offs = token.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0)
    if DOT_IN_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

    # The tile's last query sees kv positions up to its own; nothing past that needs loading.
    last_token = tl.minimum(tile_q_start + BLOCK_Q, seq_q_end) - 1
    kv_bound = context_len + (last_token - seq_q_start) + 1
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for kv_start in range(0, kv_bound, BLOCK_N):
        k, v, kv_pos = _load_kv_tile(
            k_cache_ptr, v_cache_ptr, block_table_row, kv_start, kv_bound, kv_head,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            dims, dim_valid, BLOCK_SIZE, BLOCK_N)
        m_i, l_i, acc = _online_softmax_step(q, k, v, kv_pos, q_pos, m_i, l_i, acc, scale_log2,
                                             DOT_PRECISION, DOT_IN_FP32)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_offs = token.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _online_softmax_step(q, k, v, kv_pos, q_pos, m_i, l_i, acc, scale_log2,
                         DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    """Fold one K/V tile into the running (max, denominator, output) of every row."""
    p_dtype = v.dtype
    if DOT_IN_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # log2 domain: exp2 below
    # Causal: a row sees keys up to its own position. Rows past the sequence's end sit beyond
    # every loaded key, and positions past kv_bound are zero-filled loads; neither is stored.
    scores = tl.where(kv_pos[None, :] <= q_pos[:, None], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    # A row that has seen nothing yet keeps a finite max so exp2 yields 0 instead of NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(scores - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    # P is rounded to V's storage dtype, as the fp16/bf16 tensor-core path needs.
    acc = tl.dot(p.to(p_dtype).to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _load_kv_tile(
    k_cache_ptr, v_cache_ptr, block_table_row, kv_start, kv_bound, kv_head,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    dims, dim_valid, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Gather BLOCK_N consecutive kv positions through the block table: K as [D, N], V as [N, D]."""
    kv_pos = kv_start + tl.arange(0, BLOCK_N)
    kv_valid = kv_pos < kv_bound
    # Per-position page lookup works for any BLOCK_N vs BLOCK_SIZE ratio; repeats hit L1.
    block = tl.load(block_table_row + kv_pos // BLOCK_SIZE, mask=kv_valid, other=0).to(tl.int64)
    in_block = (kv_pos % BLOCK_SIZE).to(tl.int64)
    mask = kv_valid[:, None] & dim_valid[None, :]
    k_offs = block[:, None] * stride_kb + in_block[:, None] * stride_ks + kv_head * stride_kh
    v_offs = block[:, None] * stride_vb + in_block[:, None] * stride_vs + kv_head * stride_vh
    k = tl.load(k_cache_ptr + k_offs + dims[None, :], mask=mask, other=0.0)
    v = tl.load(v_cache_ptr + v_offs + dims[None, :], mask=mask, other=0.0)
    return tl.trans(k), v, kv_pos


def _interpreting():
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check_inputs(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens):
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must both be [num_blocks, block_size, Hkv, D], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} != cache head_dim {head_dim}")
    if q.shape[1] % num_kv_heads != 0:
        raise ValueError(f"num q heads {q.shape[1]} is not a multiple of num kv heads {num_kv_heads}")
    if block_size & (block_size - 1) or block_size < 1:
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if q.dtype not in _SUPPORTED_DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q/k_cache/v_cache must share one of {_SUPPORTED_DTYPES}, got "
                         f"{q.dtype}/{k_cache.dtype}/{v_cache.dtype}")
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32:
        raise ValueError("block_tables must be a 2-D int32 tensor [S, max_blocks]")
    num_seqs = block_tables.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or query_start_loc.dtype != torch.int32:
        raise ValueError(f"query_start_loc must be int32 of shape ({num_seqs + 1},)")
    if seq_lens.shape != (num_seqs,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32 of shape ({num_seqs},)")
    tensors = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                   query_start_loc=query_start_loc, seq_lens=seq_lens)
    for name, t in tensors.items():
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q is on {q.device}")
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if not query_start_loc.is_contiguous() or not seq_lens.is_contiguous():
        raise ValueError("query_start_loc and seq_lens must be contiguous")


def _pick_block_m(num_tokens, num_seqs, group_pad):
    """Rows per tile. Decode-heavy batches (about one token per sequence) get a small tile so
    padding rows cost little; prefill-heavy ones a large tile so each K/V page feeds more rows.
    Decided from shapes only, so no device value is read."""
    avg_q_len = num_tokens / max(num_seqs, 1)
    block_q = 1 if avg_q_len <= 2 else 64 // group_pad
    return max(16, group_pad * triton.next_power_of_2(max(block_q, 1)))


def paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                    block_n=None):
    """Causal attention of each sequence's query rows over its paged KV cache (see docs/design.md).

    block_n: kv positions per inner-loop step (power of two, >= 16, independent of the cache's
    block size); default max(64, block_size). benchmarks/gpu_check.py sweeps it.
    """
    _check_inputs(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = block_tables.shape[0]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_m = _pick_block_m(num_tokens, num_seqs, group_pad)
    block_n = block_n or max(64, block_size)
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    block_q = block_m // group_pad
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    # fp32 inputs would otherwise run through TF32 on GPUs and lose ~3 decimal digits.
    precision = "ieee" if q.dtype == torch.float32 else None
    # Triton's CPU interpreter multiplies bf16 tl.dot operands as raw integers; exact fp32
    # products of the same bf16 values give the GPU's numerics there.
    dot_in_fp32 = q.dtype == torch.bfloat16 and (_interpreting() or q.device.type == "cpu")
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens,
        num_seqs, float(scale) * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PRECISION=precision, DOT_IN_FP32=dot_in_fp32,
    )
    return out


__all__ = ["paged_attention"]
