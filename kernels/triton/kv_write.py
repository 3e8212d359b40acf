"""Triton KV-cache write: scatter each token's K/V heads into its paged-cache slot.

One program per token moves all of that token's kv heads at once (a [Hkv, D] tile), so the
number of programs is T and each one issues a single contiguous-ish store per cache.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return  # padding token or a position whose KV is already cached
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HEAD_DIM)
    t = token.to(tl.int64)
    k = tl.load(k_ptr + t * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + heads * stride_vh + dims, mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + heads * stride_kch + dims
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + heads * stride_vch + dims
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _check_inputs(k, v, k_cache, v_cache, slot_mapping):
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"k and v must both be [T, Hkv, D], got {tuple(k.shape)} and {tuple(v.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must both be [num_blocks, block_size, Hkv, D], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if tuple(k.shape[1:]) != tuple(k_cache.shape[2:]):
        raise ValueError(f"k heads/dim {tuple(k.shape[1:])} != cache {tuple(k_cache.shape[2:])}")
    block_size = k_cache.shape[1]
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64 of shape ({k.shape[0]},), got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    for name, t in dict(v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping).items():
        if t.device != k.device:
            raise ValueError(f"{name} is on {t.device}, k is on {k.device}")
    for name, t in dict(k=k, v=v, k_cache=k_cache, v_cache=v_cache).items():
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be contiguous")


def write_kv(k, v, k_cache, v_cache, slot_mapping):
    """k/v [T, Hkv, D] -> k_cache/v_cache[slot // bs, slot % bs]; slot -1 is skipped.

    Slots are not range-checked on the device (that would need a host sync); the caller owns
    them, as with the reference's index_copy_.
    """
    _check_inputs(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_heads), DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
    )
