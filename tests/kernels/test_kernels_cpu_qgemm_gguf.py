"""The VNNI products over GGUF weights as the model loads them: Q4_1 / Q4_0 / Q8_0 blocks in the
file's own byte layout, converted by engine/models/gguf_loader.py (so Q4_1's fp16 min as the
offset, Q4_0's -8d), at SmolLM2-135M's shapes (fused q|k|v, o, fused gate|up, down, k / v, an
lm_head slice) and batch sizes that take each of the kernel's paths: 1 (decode), 4 (one row tile),
37 (the chat prompt of a short question), 300 (threads split rows).

test_kernels_cpu_qgemm_vnni.py checks the arithmetic on synthetic QTensors (random offsets, scales of
either sign); this one pins it to what the GGUF reader hands the packer, and to activations with
the model's outlier channels (a final-norm or down_proj input carries a few at 15-30x the rms),
which widen the int8 blocks that hold them.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from genpool.engine.models.gguf_loader import QUANT_TYPES, _blocks_to_qtensor
from genpool.kernels.cpu import qgemm as cpu_qgemm
from tests.kernels.test_kernels_cpu_qgemm_vnni import emulate

pytestmark = pytest.mark.skipif(not (cpu_qgemm.available() and cpu_qgemm.vnni_available()),
                                reason="this build has no integer dot products (AVX512-VNNI or AVX2)")

# (N, K): q|k|v fused 576 + 2 * 192, o, gate|up fused 2 * 1536, down, k (or v), lm_head rows
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (192, 576), (4096, 576)]
ROWS = [1, 4, 37, 300]


def gguf_blocks(ttype: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random blocks as a GGUF file stores them: fp16 d (> 0, the size of SmolLM2's), Q4_1's fp16
    min m ~ -8d (so W = d q + m is centred, as the quantizer leaves it), then the quants."""
    rng = np.random.default_rng(seed)
    bits, per, nbytes = QUANT_TYPES[ttype]
    blocks = np.empty((n, k // per, nbytes), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.5, (n, k // per)) * (0.02 if bits == 4 else 0.002)).astype(np.float16)
    blocks[..., 0:2] = d.view(np.uint8).reshape(n, k // per, 2)
    start = 2
    if ttype == "Q4_1":
        m = (-d.astype(np.float32) * rng.uniform(7.0, 9.0, d.shape)).astype(np.float16)
        blocks[..., 2:4] = m.view(np.uint8).reshape(n, k // per, 2)
        start = 4
    blocks[..., start:] = rng.integers(0, 256, (n, k // per, nbytes - start), dtype=np.uint8)
    return blocks


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, torch.randperm(k, generator=g)[:3]] *= 25.0  # outlier channels, as SmolLM2's hidden states
    return x


def _needs(ttype: str) -> None:
    if not QUANT_TYPES[ttype][0] & cpu_qgemm.dot_bits():
        pytest.skip(f"{ttype} does not run on this build's dot products")


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("ttype", ["Q4_1", "Q4_0", "Q8_0"])
def test_gguf_weights_on_vnni_are_int8_activations_times_the_exact_weight(ttype, n, k, m):
    _needs(ttype)
    w = _blocks_to_qtensor("t", ttype, gguf_blocks(ttype, n, k, n + k), n, k)
    packed = cpu_qgemm.QPackedWeight(w, layout="vnni")
    x = activations(m, k, m + n)
    got = cpu_qgemm.qgemm(x, packed)
    want = emulate(x, w, None)  # W times the int8-quantized x, in float64
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-6 * want.abs().max().item())
    exact = x.double() @ w.dequantize().double().t()
    # int8 blocks of 32: rounding error <= dx / 2 per input, ~0.3% of |x| rms in a plain block and
    # ~8% in one holding a 25x outlier; measured 0.8-1.4% here (the model's own products: 0.3-1.2%)
    assert (got.double() - exact).norm() / exact.norm() < 0.02


@pytest.mark.parametrize("m", [1, 37])
@pytest.mark.parametrize("ttype", ["Q4_1", "Q4_0", "Q8_0"])
def test_gguf_gate_up_swiglu_on_vnni_is_silu_mul_of_the_product(ttype, m):
    from genpool.kernels.cpu import silu_mul as cpu_silu_mul
    _needs(ttype)
    n, k = 3072, 576
    w = _blocks_to_qtensor("t", ttype, gguf_blocks(ttype, n, k, 7), n, k)
    packed = cpu_qgemm.QPackedWeight(w, layout="vnni")
    assert packed.swiglu_fusable
    x = activations(m, k, 11)
    assert torch.equal(cpu_qgemm.qgemm_swiglu(x, packed), cpu_silu_mul.silu_and_mul(cpu_qgemm.qgemm(x, packed)))
