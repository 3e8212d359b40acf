"""The CPU kernel backend: the torch reference with its hot spots replaced by C kernels.

Decode rows of paged attention go to kernels/cpu_decode_attention.c, which reads K/V in place
from the paged cache instead of gathering padded copies; prefill chunks keep the reference's
fused SDPA (compute-bound, where torch's flash kernel is hard to beat). `build_backend()` returns
None when the C kernels cannot be built (no compiler), and the caller uses "torch" instead.
"""
from __future__ import annotations

from functools import partial
from types import SimpleNamespace

from kernels import cpu_decode_attention, ref


def build_backend() -> SimpleNamespace | None:
    if not cpu_decode_attention.available():
        return None
    attention = partial(ref.mixed_attention, decode_rows=cpu_decode_attention.decode_attention)
    return SimpleNamespace(name="cpu", write_kv=ref.write_kv, paged_attention=attention,
                           rms_norm=ref.rms_norm, rotary=ref.rotary)
