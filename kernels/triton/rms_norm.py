"""Triton fused residual add + RMSNorm, one program per row.

Numerics follow the reference (HF Llama): the residual sum is rounded to the input dtype (it is
what the next layer adds to), the norm is taken in fp32, cast back to the input dtype, and only
then multiplied by the weight in the promoted dtype.
"""
import torch
import triton
import triton.language as tl

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr,
    stride_x, stride_r, stride_o, stride_nr, hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * stride_nr + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _check_inputs(x, weight, residual):
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got shape {tuple(x.shape)}")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"weight must be [{x.shape[1]}], got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    tensors = dict(x=x, weight=weight) if residual is None else dict(x=x, weight=weight, residual=residual)
    for name, t in tensors.items():
        if t.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"{name} dtype {t.dtype} not in {_SUPPORTED_DTYPES}")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x is on {x.device}")
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if residual is not None and residual.dtype != x.dtype:
        raise ValueError(f"residual dtype {residual.dtype} != x dtype {x.dtype}")


def rms_norm(x, weight, eps, residual=None):
    """Returns (weight * norm(x'), x') with x' = x + residual if residual is given, else x."""
    _check_inputs(x, weight, residual)
    num_rows, hidden = x.shape
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    new_residual = x if residual is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    if num_rows == 0:
        return out, new_residual
    r = x if residual is None else residual  # placeholder pointer when there is no residual
    _rms_norm_kernel[(num_rows,)](
        x, r, weight, out, new_residual,
        x.stride(0), r.stride(0), out.stride(0), new_residual.stride(0), hidden, float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden),
    )
    return out, new_residual
