"""kernels/cpu/cpu_qgemm_amx.c: prompt-sized products of int8 per-channel weights on AMX bf16 tiles.

The tiles multiply x rounded to bf16 by the exact int8 weights and sum in fp32, so the result must
match a float64 product of bf16(x) and the weights to fp32 summation error, and be closer to the
exact product than the int8 dot products (which quantize x per block of 32); every other weight
(groups, offsets, int4) and every batch below 32 rows keeps the dot products' bits.
"""
from __future__ import annotations

import pytest
import torch

from genpool.engine.models.quant import quantize_int8
from genpool.kernels.cpu import qgemm as cpu_qgemm
from genpool.kernels.cpu import silu_mul as cpu_silu_mul
from genpool.kernels.qtensor import QTensor
from genpool.kernels.settings import kernel_settings_as

pytestmark = pytest.mark.skipif(not (cpu_qgemm.available() and cpu_qgemm.amx_available()),
                                reason="no AMX tiles here (CPU or OS)")


def _packed(w: QTensor, mode: str, bias: torch.Tensor | None = None) -> cpu_qgemm.QPackedWeight:
    with kernel_settings_as(quant_compute=mode):
        return cpu_qgemm.QPackedWeight(w, bias)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("m,n,k", [(32, 64, 64), (33, 70, 96), (100, 960, 576), (512, 576, 1536), (64, 17, 32)])
def test_tile_product_is_bf16_x_times_the_exact_weights(m, n, k):
    torch.manual_seed(m + n + k)
    w, bias, x = quantize_int8(torch.randn(n, k) * 0.05), torch.randn(n), torch.randn(m, k)
    packed = _packed(w, "amx", bias)
    assert packed.struct.amx == 1
    got = cpu_qgemm.qgemm(x, packed)
    want = x.to(torch.bfloat16).double() @ w.dequantize().double().t() + bias.double()
    # fp32 sums of K products whose terms are exact: ~K * 2^-24 of the sum of magnitudes
    bound = k * 2.0 ** -23 * (x.to(torch.bfloat16).double().abs() @ w.dequantize().double().abs().t()) + 1e-6
    assert ((got.double() - want).abs() <= bound).all()
    exact = x.double() @ w.dequantize().double().t() + bias.double()
    dots = cpu_qgemm.qgemm(x, _packed(w, "vnni", bias))
    assert _rel(got, exact) < 0.5 * _rel(dots, exact)  # bf16 x is finer than int8 blocks of 32


@pytest.mark.parametrize("m", [32, 100])
def test_tile_swiglu_is_silu_mul_of_the_tile_product(m):
    torch.manual_seed(m)
    inter, k = 2 * cpu_qgemm.VNNI_PANEL * 3, 96
    packed, x = _packed(quantize_int8(torch.randn(2 * inter, k)), "amx"), torch.randn(m, k)
    assert packed.swiglu_fusable
    assert torch.equal(cpu_qgemm.qgemm_swiglu(x, packed), cpu_silu_mul.silu_and_mul(cpu_qgemm.qgemm(x, packed)))


def test_small_batches_and_other_weights_keep_the_dot_products_bits():
    torch.manual_seed(0)
    int8 = quantize_int8(torch.randn(64, 128))
    q8_0 = QTensor(torch.randint(-127, 128, (64, 128), dtype=torch.int8), torch.rand(64, 4) * 0.01, None, 8, 32,
                   (64, 128), "Q8_0")  # groups of 32: the tiles would need a scale per group
    assert _packed(q8_0, "amx").struct.amx == 0 and _packed(int8, "amx").struct.amx == 1
    for w, m in ((int8, 31), (int8, 1), (q8_0, 100)):
        x = torch.randn(m, 128)
        assert torch.equal(cpu_qgemm.qgemm(x, _packed(w, "amx")), cpu_qgemm.qgemm(x, _packed(w, "vnni")))


def test_results_do_not_depend_on_the_thread_count():
    torch.manual_seed(1)
    w, x = quantize_int8(torch.randn(300, 256)), torch.randn(70, 256)
    packed, before = _packed(w, "amx"), torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_qgemm.qgemm(x, packed)
        torch.set_num_threads(2)
        assert torch.equal(cpu_qgemm.qgemm(x, packed), one)
    finally:
        torch.set_num_threads(before)


def test_a_forked_child_runs_the_tiles():
    """Celery's prefork workers: the child inherits the tile permission and gets a pool of its own."""
    import subprocess
    import sys
    import textwrap
    script = textwrap.dedent("""
        import os, torch
        from genpool.engine.models.quant import quantize_int8
        from genpool.kernels.cpu import qgemm
        from genpool.kernels.settings import kernel_settings_as
        torch.set_num_threads(2)
        with kernel_settings_as(quant_compute="amx"):
            w = qgemm.QPackedWeight(quantize_int8(torch.randn(256, 128)))
        assert w.struct.amx == 1
        x = torch.randn(64, 128)
        want = qgemm.qgemm(x, w)  # the parent has run the tiles
        pid = os.fork()
        if pid == 0:
            os._exit(0 if all(torch.equal(qgemm.qgemm(x, w), want) for _ in range(10)) else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
