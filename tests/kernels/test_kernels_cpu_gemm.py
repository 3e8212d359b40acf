"""kernels/cpu/cpu_gemm.c (fp32 x @ W over a packed weight) and the model's use of it.

Accuracy is judged against a float64 product: the kernel's error must be of the order of the
reference's (x @ weight_t through torch/MKL), not merely "close to MKL". Each output element is
one FMA chain over k, so a row's result must not depend on the batch or the thread count: those
checks are bit-exact.
"""
import stat

import pytest
import torch

from genpool.engine.models.llama import Linear
from genpool.kernels import get_backend, ref
from genpool.kernels import settings as kernel_settings_module
from genpool.kernels.cpu import backend as cpu_backend
from genpool.kernels.cpu import build as cpu_build
from genpool.kernels.cpu import gemm as cpu_gemm
from genpool.kernels.cpu import prefill_attention as cpu_prefill_attention
from genpool.kernels.cpu import silu_mul as cpu_silu_mul

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="no C compiler here")


def case(m, k, n, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(k, n, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    return x, w, b


def one_thread(fn):
    """fn() with torch, and so the C kernels, on one thread."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        return fn()
    finally:
        torch.set_num_threads(threads)


def exact(x, w, b):
    y = x.double() @ w.double()
    return y if b is None else y + b.double()


@pytest.mark.parametrize("m,k,n,bias", [
    (1, 576, 576, False),   # a decode GEMV
    (5, 7, 17, True),       # fewer rows than a tile, a partial panel, odd K
    (6, 64, 16, False),     # exactly one tile and one panel
    (13, 48, 40, True),     # two tiles and a remainder row, 2.5 panels
    (100, 1536, 20, False), # more rows than one L2 block (MC = 42 for K = 1536)
    (48, 576, 960, True),   # a decode-sized qkv with bias (Qwen2-style)
    (400, 576, 100, True),  # prompt-sized: threads split the rows (up to 8 threads); a panel pair, then a partial one
])
def test_gemm_is_as_accurate_as_the_reference(m, k, n, bias):
    x, w, b = case(m, k, n, bias)
    got = cpu_gemm.gemm(x, cpu_gemm.PackedWeight(w, b))
    want = ref.linear(x, ref.pack_linear(w, b))
    truth = exact(x, w, b)
    assert got.shape == (m, n) and got.dtype == torch.float32
    err, ref_err = (got.double() - truth).abs().max().item(), (want.double() - truth).abs().max().item()
    assert err <= 4 * ref_err + 1e-6 * k ** 0.5, (err, ref_err)


# K slices and row blocks: one and one, several and two; (150, 600, 128): whole panel pairs straight into y
@pytest.mark.parametrize("m,k,n", [(23, 200, 70), (150, 600, 40), (150, 600, 128)])
def test_a_rows_result_does_not_depend_on_the_batch_or_threads(m, k, n):
    x, w, _ = case(m, k, n, False, seed=1)
    pw = cpu_gemm.PackedWeight(w)
    full = cpu_gemm.gemm(x, pw)
    for lo, hi in [(0, 1), (3, 4), (5, 12), (17, 23), (1, 23), (100, m)]:  # rows at other tile positions
        assert torch.equal(cpu_gemm.gemm(x[lo:hi], pw), full[lo:hi])
    assert torch.equal(one_thread(lambda: cpu_gemm.gemm(x, pw)), full)


def test_strided_rows_and_empty_batches():
    wide = torch.randn(9, 100)
    x = wide[:, 10:74]  # rows 100 apart, 64 wide
    w = torch.randn(64, 30)
    pw = cpu_gemm.PackedWeight(w)
    assert torch.equal(cpu_gemm.gemm(x, pw), cpu_gemm.gemm(x.contiguous(), pw))
    assert cpu_gemm.gemm(torch.empty(0, 64), pw).shape == (0, 30)
    empty_k = cpu_gemm.PackedWeight(torch.empty(0, 5), torch.arange(5.0))  # an empty sum: the bias
    assert torch.equal(cpu_gemm.gemm(torch.empty(3, 0), empty_k), torch.arange(5.0).expand(3, 5))


def test_launcher_checks_its_inputs():
    pw = cpu_gemm.PackedWeight(torch.randn(8, 4))
    with pytest.raises(ValueError, match="float32"):
        cpu_gemm.gemm(torch.randn(2, 8, dtype=torch.bfloat16), pw)
    with pytest.raises(ValueError, match=r"\[M, 8\]"):
        cpu_gemm.gemm(torch.randn(2, 9), pw)
    with pytest.raises(ValueError, match="pack"):
        cpu_gemm.PackedWeight(torch.randn(8, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bias"):
        cpu_gemm.PackedWeight(torch.randn(8, 4), torch.randn(5))


@pytest.mark.parametrize("m,k,panels", [
    (1, 576, 3),     # a decode GEMV: threads split the gate panels
    (5, 7, 1),       # fewer rows than a tile, odd K, one pair
    (20, 600, 4),    # several K slices; tiles of 5 rows
    (48, 576, 48),   # SmolLM2's decode MLP (I = 1536 on AVX-512)
    (400, 576, 3),   # prompt-sized: threads split the rows
    (250, 1536, 2),  # more rows than one L2 block
])
def test_swiglu_epilogue_gives_the_bits_of_the_two_kernels(m, k, panels):
    inter = panels * cpu_gemm.panel_width()
    x, w, _ = case(m, k, 2 * inter, False, seed=2)
    pw = cpu_gemm.PackedWeight(w)
    assert pw.swiglu_fusable
    got = cpu_gemm.gemm_swiglu(x, pw)
    assert got.shape == (m, inter)
    assert torch.equal(got, cpu_silu_mul.silu_and_mul(cpu_gemm.gemm(x, pw)))
    truth = ref.silu_and_mul(x.double() @ w.double())
    err, ref_err = (got.double() - truth).abs().max().item(), (ref.silu_and_mul(x @ w).double() - truth).abs().max().item()
    assert err <= 4 * ref_err + 1e-5, (err, ref_err)
    assert torch.equal(one_thread(lambda: cpu_gemm.gemm_swiglu(x, pw)), got)
    assert torch.equal(cpu_gemm.gemm_swiglu(x[m // 2:], pw), got[m // 2:])  # rows at other tile positions


def test_swiglu_epilogue_takes_whole_panels_only_and_the_backend_falls_back():
    nr = cpu_gemm.panel_width()
    cpu = get_backend("cpu")
    x = torch.randn(7, 40)
    for w, b in [(torch.randn(40, 2 * nr + 2), None), (torch.randn(40, 2 * nr), torch.randn(2 * nr))]:
        pw = cpu_gemm.PackedWeight(w, b)  # I not whole panels; a bias
        assert not pw.swiglu_fusable
        with pytest.raises(ValueError, match="fused"):
            cpu_gemm.gemm_swiglu(x, pw)
        want = ref.gate_up_silu(x, ref.pack_linear(w, b))
        torch.testing.assert_close(cpu.gate_up_silu(x, pw), want, rtol=1e-4, atol=1e-4)
    assert cpu_gemm.gemm_swiglu(torch.empty(0, 40), cpu_gemm.PackedWeight(torch.randn(40, 2 * nr))).shape == (0, nr)
    with pytest.raises(ValueError, match=r"\[M, 40\]"):
        cpu_gemm.gemm_swiglu(torch.randn(2, 41), cpu_gemm.PackedWeight(torch.randn(40, 2 * nr)))


def test_linear_layers_pack_for_their_backend(monkeypatch):
    monkeypatch.setattr(kernel_settings_module, "_current", None)  # the environment's, not an earlier engine's
    monkeypatch.setenv("GENPOOL_CPU_GEMM", "1")
    lin = Linear(32, 24, bias=True)
    torch.nn.init.normal_(lin.weight_t)
    torch.nn.init.normal_(lin.bias)
    x = torch.randn(3, 32)
    with pytest.raises(RuntimeError, match="pack"):
        lin(x)
    want = x @ lin.weight_t.detach() + lin.bias.detach()
    lin.pack(get_backend("torch"))
    assert lin.weight_t is not None  # the reference computes from the loaded weight
    torch.testing.assert_close(lin(x), want)
    cpu = get_backend("cpu")
    lin.pack(cpu)
    assert lin.weight_t is None and isinstance(lin.packed, cpu_gemm.PackedWeight)  # held once
    assert lin.packed.panels.grad_fn is None
    torch.testing.assert_close(lin(x), want)
    bf = Linear(32, 24).to(torch.bfloat16)
    torch.nn.init.normal_(bf.weight_t)
    w = bf.weight_t.detach().clone()
    monkeypatch.setattr(cpu_backend, "bf16_matmul_hardware", lambda: False)
    bf.pack(cpu)  # bf16 without bf16 hardware: widened once, fp32 FMAs, rounded to bf16 once
    got, xb = bf(x.bfloat16()), x.bfloat16()
    assert got.dtype == torch.bfloat16 and isinstance(bf.packed, cpu_gemm.PackedWeight)
    exact = (xb.double() @ w.double()).float()
    torch.testing.assert_close(got.float(), exact, rtol=2 ** -8, atol=1e-6)  # within one bf16 rounding
    native = Linear(32, 24).to(torch.bfloat16)
    native.weight_t.data.copy_(w)
    monkeypatch.setattr(cpu_backend, "bf16_matmul_hardware", lambda: True)
    native.pack(cpu)  # with AMX / AVX512-BF16: torch's bf16 GEMM on the weight as loaded
    assert isinstance(native.packed, tuple) and native.packed[0].dtype == torch.bfloat16
    torch.testing.assert_close(native(xb), xb @ w)


def test_bf16_hardware_is_read_from_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(cpu_build, "cpu_has", lambda flag: flag == "amx_bf16")
    assert cpu_backend.bf16_matmul_hardware()
    monkeypatch.setattr(cpu_build, "cpu_has", lambda flag: flag == "avx2")
    assert not cpu_backend.bf16_matmul_hardware()


def test_build_needs_no_openmp_runtime(tmp_path, monkeypatch):
    # The threads are the kernels' own pool (cpu_pool.c): a compiler that has no OpenMP library
    # (clang without libomp) builds the same libraries, which run threaded and give the same bits.
    real = cpu_build._compiler()
    cc = tmp_path / "cc-without-openmp"
    cc.write_text(f'#!/bin/sh\nfor a in "$@"; do case "$a" in -fopenmp|-lgomp) exit 1;; esac; done\nexec {real} "$@"\n')
    cc.chmod(cc.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("GENPOOL_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setattr(cpu_build, "_loaded", {})
    lib = cpu_build.load("cpu_gemm")
    built = list((tmp_path / "kernels").glob("cpu_gemm-*.so"))
    assert lib is not None and len(built) == 1
    assert built[0] == cpu_build.library_path("cpu_gemm", str(cc))
    x, w, _ = case(30, 64, 40, False)
    fn = lib.gemm_packed
    fn.argtypes = cpu_gemm._kernel().argtypes
    pw = cpu_gemm.PackedWeight(w)
    y = torch.empty(30, 40)
    assert fn(x.data_ptr(), pw.panels.data_ptr(), 0, y.data_ptr(), 30, 64, 40, 64, 40, 2) == 0
    assert torch.equal(y, cpu_gemm.gemm(x, pw))


def test_tile_kernels_are_the_default_and_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(kernel_settings_module, "_current", None)  # the environment's, not an earlier engine's
    monkeypatch.delenv("GENPOOL_CPU_GEMM", raising=False)
    assert cpu_backend.use_tile_kernels()
    assert get_backend("cpu").paged_attention.keywords["prefill"] is cpu_prefill_attention.prefill_rows
    monkeypatch.setenv("GENPOOL_CPU_GEMM", "0")
    assert not cpu_backend.use_tile_kernels()
    lin = Linear(8, 4)
    lin.pack(get_backend("cpu"))
    assert isinstance(lin.packed, tuple)  # torch's GEMM, the weight as loaded
    assert get_backend("cpu").paged_attention.keywords["prefill"] is ref.prefill_rows
    monkeypatch.setenv("GENPOOL_CPU_GEMM", "1")
    assert cpu_backend.use_tile_kernels()


def test_cpu_flags_are_read_from_cpuinfo():
    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split(":", 1)[1].split()
    assert cpu_build.cpu_has(flags[0]) and not cpu_build.cpu_has("no_such_flag")
