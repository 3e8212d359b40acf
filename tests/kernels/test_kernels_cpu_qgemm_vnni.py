"""kernels/cpu/cpu_qgemm_vnni.c: quantized products on integer dot products (AVX512-VNNI's vpdpbusd;
AVX2's vpmaddubsw, with vpsignb for int8 weights).

The kernel quantizes each row of x to int8 per block of 32 inputs and multiplies bytes, so it is not the
exact product; what it must be is exactly that arithmetic: the same result as a float64 emulation
of it (round-to-nearest-even int8 activations, exact integer sums, fp32 scales), whatever the batch,
the thread count or the layout's padding, and close to the exact product.
"""
from __future__ import annotations

import pytest
import torch

from genpool.engine.models.quant import quantize_int8
from genpool.kernels.cpu import qgemm as cpu_qgemm
from genpool.kernels.qtensor import QTensor, pack_nibbles
from tests.engine.test_quant import _int4

pytestmark = pytest.mark.skipif(not (cpu_qgemm.available() and cpu_qgemm.vnni_available()),
                                reason="this build has no integer dot products (AVX512-VNNI or AVX2)")
BITS = {"int8": 8, "q8_0": 8, "int4": 4, "int4-g128": 4, "int4-no-offset": 4}


@pytest.fixture(autouse=True)
def _dot_products_only():
    """These tests hold the vpdpbusd arithmetic, whatever GENPOOL_QUANT_COMPUTE the run has (amx
    would send int8 products of 32+ rows to the tiles: tests/kernels/test_kernels_cpu_qgemm_amx.py)."""
    from genpool.kernels.settings import kernel_settings_as
    with kernel_settings_as(quant_compute="vnni"):
        yield


def _needs(kind: str) -> None:
    if not BITS[kind] & cpu_qgemm.dot_bits():
        pytest.skip(f"{kind} weights do not run on this build's dot products ")


def _weight(kind: str, n: int, k: int) -> QTensor:
    torch.manual_seed(n + k)
    if kind == "int8":  # per output channel: one group of all K
        return quantize_int8(torch.randn(n, k))
    if kind == "q8_0":  # signed int8 in groups of 32, no offset (GGUF Q8_0)
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        return QTensor(q, torch.rand(n, k // 32).half().float() * 0.01, None, 8, 32, (n, k), "Q8_0")
    if kind == "int4-g128":
        return _int4(n, k, 128)
    return _int4(n, k, 32, offsets=kind == "int4")


def emulate(x: torch.Tensor, w: QTensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's arithmetic in float64: xq = round(x * (127 / max|x|)) per row and block of 32,
    exact integer sums of q * xq per block, times fp32(scale * dx); offsets times the group's
    fp32 sum of dx * sum(xq)."""
    m, (n, k), g, ab = x.shape[0], w.shape, w.group, cpu_qgemm.VNNI_BLOCK
    xb = x.view(m, k // ab, ab)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))  # fp32, as the kernel divides
    xq = torch.round(xb * inv).to(torch.int64)  # nearest even, as vcvtps2dq
    dx = (amax / 127.0).squeeze(-1)  # [m, blocks]
    q = w.ints().to(torch.int64).view(n, k // ab, ab)
    dots = torch.einsum("mbk,nbk->mnb", xq, q).double()  # exact
    scale = w.scale.repeat_interleave(g // ab, dim=1)  # each block's group scale [n, blocks]
    y = (dots * (scale.unsqueeze(0) * dx.unsqueeze(1)).double()).sum(-1)  # fp32 products, as the kernel's
    if w.offset is not None:
        sx = (dx * xq.sum(-1).float()).view(m, k // g, g // ab).sum(-1)  # [m, groups]
        y += (w.offset.double().unsqueeze(0) * sx.double().unsqueeze(1)).sum(-1)
    if bias is not None:
        y += bias.double()
    return y


SHAPES = [(1, 100, 64), (5, 576, 576), (7, 40, 96), (20, 1536, 576), (150, 200, 256)]


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("kind", ["int8", "q8_0", "int4", "int4-g128", "int4-no-offset"])
def test_vnni_product_is_its_integer_arithmetic_and_close_to_the_exact_one(m, n, k, kind):
    _needs(kind)
    w = _weight(kind, n, k if kind != "int4-g128" else max(128, k // 128 * 128))
    x, bias = torch.randn(m, w.shape[1]) * 3, torch.randn(n)
    packed = cpu_qgemm.QPackedWeight(w, bias, layout="vnni")
    got = cpu_qgemm.qgemm(x, packed)
    want = emulate(x, w, bias)
    scale = want.abs().max().item()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-6 * scale)
    exact = x @ w.dequantize().t() + bias
    assert ((got - exact).norm() / exact.norm()) < 0.02  # int8 activations: ~0.5% here


def test_int8_extremes_are_summed_exactly():
    """The largest byte products on every build: weights of -128 and 127 against activations of
    +-127 (AVX2 multiplies |q| by x carrying q's sign in 16-bit pair sums, which must not saturate)."""
    _needs("q8_0")
    n, k = 40, 256
    torch.manual_seed(1)
    q = torch.tensor([-128, 127, -127, 0, 1, -1], dtype=torch.int8)[torch.randint(0, 6, (n, k))]
    q[0], q[1] = -128, 127  # whole rows at the extremes
    w = QTensor(q, torch.rand(n, k // 32) * 0.01 + 0.001, None, 8, 32, (n, k), "Q8_0")
    x = torch.randn(9, k).sign() * 2  # every block's max is 2: each activation quantizes to +-127
    x[0], x[1] = 2.0, -2.0
    got = cpu_qgemm.qgemm(x, cpu_qgemm.QPackedWeight(w, layout="vnni"))
    want = emulate(x, w, None)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-6 * want.abs().max().item())
    assert torch.allclose(got, x @ w.dequantize().t(), rtol=1e-4, atol=1e-3)


def test_a_row_does_not_depend_on_its_batch_or_the_thread_count():
    w = _weight("int4", 300, 576)
    packed = cpu_qgemm.QPackedWeight(w, layout="vnni")
    x = torch.randn(64, 576)
    full = cpu_qgemm.qgemm(x, packed)  # prompt-sized: rows split between threads
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = cpu_qgemm.qgemm(x, packed)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(full, one)
    for r in (0, 5, 63):  # decode-sized: panels split between threads
        assert torch.equal(cpu_qgemm.qgemm(x[r:r + 1], packed), full[r:r + 1])


def test_zero_and_empty_inputs():
    packed = cpu_qgemm.QPackedWeight(_weight("int4", 48, 64), layout="vnni")
    assert torch.equal(cpu_qgemm.qgemm(torch.zeros(3, 64), packed), torch.zeros(3, 48))
    assert cpu_qgemm.qgemm(torch.zeros(0, 64), packed).shape == (0, 48)


@pytest.mark.parametrize("m", [1, 7, 150])
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_vnni_swiglu_is_silu_mul_of_the_product(m, kind):
    from genpool.kernels.cpu import silu_mul as cpu_silu_mul
    _needs(kind)
    inter, k = 2 * cpu_qgemm.VNNI_PANEL * 3, 96
    w = _weight(kind, 2 * inter, k)
    packed = cpu_qgemm.QPackedWeight(w, layout="vnni")
    assert packed.swiglu_fusable
    x = torch.randn(m, k)
    assert torch.equal(cpu_qgemm.qgemm_swiglu(x, packed), cpu_silu_mul.silu_and_mul(cpu_qgemm.qgemm(x, packed)))


def test_compute_mode_follows_the_environment(monkeypatch):
    from genpool.kernels import settings as kernel_settings_module
    best = "amx" if cpu_qgemm.amx_available() else "vnni"
    monkeypatch.setattr(kernel_settings_module, "_current", None)  # the environment's, as before an engine
    try:
        for env, mode in (("fp32", "fp32"), ("vnni", "vnni"), ("amx", best), ("", "vnni"), ("auto", "vnni")):
            monkeypatch.setenv("GENPOOL_QUANT_COMPUTE", env)
            cpu_qgemm.compute_mode.cache_clear()
            assert cpu_qgemm.compute_mode() == mode
            want = "vnni" if mode in cpu_qgemm.DOT_MODES else "panels"
            assert cpu_qgemm.QPackedWeight(_weight("int4", 32, 64)).layout == want
        monkeypatch.setenv("GENPOOL_QUANT_COMPUTE", "int3")
        cpu_qgemm.compute_mode.cache_clear()
        with pytest.raises(ValueError, match="GENPOOL_QUANT_COMPUTE='int3'"):
            cpu_qgemm.compute_mode()
    finally:
        cpu_qgemm.compute_mode.cache_clear()


def test_groups_the_vnni_layout_cannot_hold_stay_on_the_widening_layout():
    ints = torch.randint(0, 16, (16, 36))
    w = QTensor(pack_nibbles(ints), torch.rand(16, 3), None, 4, 12, (16, 36), "odd")  # groups of 12
    assert not cpu_qgemm.vnni_fits(w)
    with pytest.raises(ValueError, match="no VNNI layout"):
        cpu_qgemm.QPackedWeight(w, layout="vnni")
    packed = cpu_qgemm.QPackedWeight(w)
    assert packed.layout == "panels"
    x = torch.randn(2, 36)
    torch.testing.assert_close(cpu_qgemm.qgemm(x, packed), x @ w.dequantize().t(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", sorted(BITS))
def test_weights_of_a_width_this_build_cannot_dot_keep_the_widening_layout(kind):
    w = _weight(kind, 32, 128)
    runs = bool(BITS[kind] & cpu_qgemm.dot_bits())
    assert cpu_qgemm.vnni_fits(w) == runs
    assert cpu_qgemm.QPackedWeight(w).layout == ("vnni" if runs and cpu_qgemm.compute_mode() == "vnni"
                                                 else "panels")
    if not runs:
        with pytest.raises(ValueError, match="no VNNI layout"):
            cpu_qgemm.QPackedWeight(w, layout="vnni")
