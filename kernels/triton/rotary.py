"""Triton neox-style ("rotate_half") rotary embedding, applied in place to q and k.

One program per token rotates all of its q heads and k heads, so the token's cos/sin row is
read once. The math runs in fp32 and is rounded back to the tensors' dtype, like the reference.
"""
import torch
import triton
import triton.language as tl

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _rotate_heads(x_ptr, stride_h, cos, sin,
                  NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
                  HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """x1, x2 = halves of each head; x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin."""
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HALF)
    first = x_ptr + heads * stride_h + dims
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    out_ty = x_ptr.dtype.element_ty
    tl.store(first, (x1 * cos - x2 * sin).to(out_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(out_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, positions_ptr, cos_sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token)
    dims = tl.arange(0, HALF_PAD)[None, :]
    row = cos_sin_ptr + pos * stride_cs + dims
    cos = tl.load(row, mask=dims < HALF, other=0.0).to(tl.float32)
    sin = tl.load(row + HALF, mask=dims < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, cos, sin,
                  NUM_Q_HEADS, Q_HEADS_PAD, HALF, HALF_PAD)
    _rotate_heads(k_ptr + token * stride_kt, stride_kh, cos, sin,
                  NUM_K_HEADS, K_HEADS_PAD, HALF, HALF_PAD)


def _check_inputs(q, k, positions, cos_sin):
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q must be [T, Hq, D] and k [T, Hkv, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    head_dim = q.shape[2]
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    if cos_sin.dim() != 2 or cos_sin.shape[1] != head_dim:
        raise ValueError(f"cos_sin must be [max_pos, {head_dim}], got {tuple(cos_sin.shape)}")
    if positions.shape != (q.shape[0],) or positions.dtype != torch.int64:
        raise ValueError(f"positions must be int64 of shape ({q.shape[0]},), got "
                         f"{positions.dtype} {tuple(positions.shape)}")
    for name, t in dict(q=q, k=k, cos_sin=cos_sin).items():
        if t.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"{name} dtype {t.dtype} not in {_SUPPORTED_DTYPES}")
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    for name, t in dict(k=k, positions=positions, cos_sin=cos_sin).items():
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q is on {q.device}")
    if not positions.is_contiguous():
        raise ValueError("positions must be contiguous")


def rotary(q, k, positions, cos_sin):
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place by cos_sin[positions]; returns (q, k).

    Positions are not range-checked on the device (that would need a host sync).
    """
    _check_inputs(q, k, positions, cos_sin)
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return q, k
    num_k_heads = k.shape[1]
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos_sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin.stride(0),
        NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads,
        Q_HEADS_PAD=triton.next_power_of_2(num_q_heads),
        K_HEADS_PAD=triton.next_power_of_2(num_k_heads),
        HALF=half, HALF_PAD=triton.next_power_of_2(half),
    )
    return q, k
