"""The Triton kernel backend: the kernels of docs/design.md's contract as one object.

`kernels.get_backend("triton")` calls `build_backend()`. Importing this module imports triton,
so it is only imported when that backend is asked for. Set TRITON_INTERPRET=1 before the first
import to run the kernels on the CPU (slowly; tests only).
"""
from types import SimpleNamespace


def build_backend() -> SimpleNamespace:
    from kernels.triton_kv_write import write_kv
    from kernels.triton_paged_attention import paged_attention
    from kernels.triton_rms_norm import rms_norm
    from kernels.triton_rotary import rotary
    from kernels.ref import linear, pack_linear  # cuBLAS
    from kernels.ref import gate_up_silu, silu_and_mul  # cuBLAS, then torch's own element-wise CUDA kernels

    return SimpleNamespace(name="triton", write_kv=write_kv, paged_attention=paged_attention,
                           rms_norm=rms_norm, rotary=rotary, silu_and_mul=silu_and_mul, gate_up_silu=gate_up_silu,
                           pack_linear=pack_linear, linear=linear, linear_keeps_weight=True)
