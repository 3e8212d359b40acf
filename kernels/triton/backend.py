"""The Triton kernel backend: the kernels of docs/design.md's contract as one object.

`kernels.get_backend("triton")` builds a `TritonBackend`. The triton modules are imported when one
is built (not when this module is), so that a test can set TRITON_INTERPRET=1 and reload them
first to run the kernels on the CPU (slowly; tests only).
"""
from genpool.kernels.backend import TorchBackend


class TritonBackend(TorchBackend):
    """Attention, KV writes, RMSNorm and rotary in Triton; linear layers on cuBLAS, or for quantized
    weights (kernels/qtensor.py) the dequantizing Triton GEMM; SwiGLU on torch's own element-wise
    CUDA kernels (the reference's)."""
    name = "triton"

    def __init__(self):
        from genpool.kernels.triton.kv_write import write_kv
        from genpool.kernels.triton.paged_attention import paged_attention
        from genpool.kernels.triton.qgemm import gate_up_silu, linear, pack_linear
        from genpool.kernels.triton.rms_norm import rms_norm
        from genpool.kernels.triton.rotary import rotary

        self.write_kv, self.paged_attention, self.rms_norm, self.rotary = write_kv, paged_attention, rms_norm, rotary
        self.linear, self.pack_linear, self.gate_up_silu = linear, pack_linear, gate_up_silu


def build_backend() -> TritonBackend:
    return TritonBackend()
