"""The C kernels of the CPU backend against the torch reference (kernels/ref.py).

Decode attention is compared with the reference's gather + SDPA path on the same inputs:
fp32 within 2e-5; bf16 within 1 bf16 ulp of the fp32 result (the kernel accumulates in fp32 and
rounds once). The kernel must refuse what it cannot read safely instead of reading past memory.
Rotary rounds exactly as the reference (bit-identical); RMSNorm's residual sum is exact and its
output within a few fp32 ulp (another summation order for the mean square); SwiGLU too
(its own vectorised exp).
"""
import pytest
import torch

from genpool.kernels import get_backend, ref
from genpool.kernels.cpu import build as cpu_build
from genpool.kernels.cpu import decode_attention as cpu_decode_attention
from genpool.kernels.cpu import gemm as cpu_gemm
from genpool.kernels.cpu import prefill_attention as cpu_prefill_attention
from genpool.kernels.cpu import rms_norm as cpu_rms_norm
from genpool.kernels.cpu import rotary as cpu_rotary
from genpool.kernels.cpu import silu_mul as cpu_silu_mul
from genpool.kernels.cpu import write_kv as cpu_write_kv
from tests.kv_cases import make_case

pytestmark = pytest.mark.skipif(not cpu_decode_attention.available(), reason="no C compiler here")


@pytest.mark.parametrize("rows,hq,hkv,d,bs,lens", [
    (1, 9, 3, 64, 16, [1]),                       # first decode token of a one-token prompt
    (3, 9, 3, 64, 16, [16, 17, 500]),             # block edges and a long row
    (5, 4, 4, 32, 8, [3, 9, 40, 8, 1]),           # no GQA, other head and block sizes
    (4, 8, 2, 128, 16, [130, 7, 64, 33]),         # head_dim 128 (the other specialised size)
    (2, 6, 3, 48, 4, [11, 5]),                    # a head size with no specialisation
    (3, 4, 2, 64, 16, [33, 100, 16]),             # GQA groups of 2 (P V two heads at once)
    (2, 10, 2, 64, 16, [40, 70]),                 # groups of 5: three heads at once, then two
    (40, 9, 3, 64, 16, list(range(20, 820, 20))), # enough work to use every thread
])
def test_decode_attention_matches_reference_fp32(rows, hq, hkv, d, bs, lens):
    q, k, v, ids, lens_t = make_case(rows, hq, hkv, d, bs, lens, torch.float32)
    want = ref._decode_rows(q, k, v, ids, lens_t, d ** -0.5)
    got = cpu_decode_attention.decode_attention(q, k, v, ids, lens_t, d ** -0.5)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("lens", [[1, 15, 16, 100, 333, 64], list(range(20, 820, 20))])
def test_fp32_queries_over_bf16_caches_give_the_bits_of_their_fp32_widening(lens):
    """kv_cache_dtype bfloat16 under an fp32 model: K/V are widened exactly as they are read, so
    the result is the fp32 kernel's over the widened caches, bit for bit (every thread count)."""
    q, k, v, ids, lens_t = make_case(len(lens), 9, 3, 64, 16, lens, torch.float32, seed=2)
    kb, vb = k.bfloat16(), v.bfloat16()
    got = cpu_decode_attention.decode_attention(q, kb, vb, ids, lens_t, 0.125)
    assert got.dtype == torch.float32
    assert torch.equal(got, cpu_decode_attention.decode_attention(q, kb.float(), vb.float(), ids, lens_t, 0.125))
    torch.testing.assert_close(got, ref._decode_rows(q, kb, vb, ids, lens_t, 0.125), atol=2e-5, rtol=2e-5)


def test_decode_attention_bf16_within_one_ulp_of_fp32():
    q, k, v, ids, lens = make_case(6, 9, 3, 64, 16, [1, 15, 16, 100, 333, 64], torch.bfloat16, seed=1)
    exact = ref._decode_rows(q.float(), k.float(), v.float(), ids, lens, 0.125)
    got = cpu_decode_attention.decode_attention(q, k, v, ids, lens, 0.125)
    assert got.dtype == torch.bfloat16
    ulp = exact.abs().clamp_min(1e-3) * 2 ** -7
    assert bool(((got.float() - exact).abs() <= ulp).all())


def test_backend_routes_decode_rows_of_a_mixed_batch_to_the_kernel():
    """Through the backend's paged_attention: two decode rows around a prefill chunk."""
    torch.manual_seed(3)
    bs, hq, hkv, d = 16, 9, 3, 64
    k = torch.randn(20, bs, hkv, d)
    v = torch.randn(20, bs, hkv, d)
    tables = torch.tensor([[4, 9, 0], [7, 1, 2], [3, 5, 0]], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 41, 42], dtype=torch.int32)  # decode, 40-token chunk, decode
    lens = torch.tensor([20, 45, 31], dtype=torch.int32)
    q = torch.randn(42, hq, d)
    cpu = get_backend("cpu")
    assert cpu.name == "cpu"
    want = ref.paged_attention(q, k, v, tables, qsl, lens, 0.125)
    got = cpu.paged_attention(q, k, v, tables, qsl, lens, 0.125)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_out_of_range_block_id_is_an_error_not_a_wild_read():
    q, k, v, ids, lens = make_case(2, 9, 3, 64, 16, [20, 20], torch.float32, num_blocks=8)
    ids[1, 1] = 8  # one past the last block
    with pytest.raises(RuntimeError, match="block id out of range"):
        cpu_decode_attention.decode_attention(q, k, v, ids, lens, 0.125)
    ids[1, 1] = -1
    with pytest.raises(RuntimeError, match="block id out of range"):
        cpu_decode_attention.decode_attention(q, k, v, ids, lens, 0.125)


def test_length_beyond_the_block_table_is_refused():
    q, k, v, ids, lens = make_case(1, 9, 3, 64, 16, [32], torch.float32)
    with pytest.raises(RuntimeError, match="outside its block table"):
        cpu_decode_attention.decode_attention(q, k, v, ids, torch.tensor([33], dtype=torch.int32), 0.125)
    with pytest.raises(RuntimeError, match="outside its block table"):
        cpu_decode_attention.decode_attention(q, k, v, ids, torch.tensor([0], dtype=torch.int32), 0.125)


@pytest.mark.parametrize("change,match", [
    (lambda c: dict(c, q=c["q"].to(torch.float16)), "dtypes"),
    (lambda c: dict(c, q=c["q"].bfloat16()), "dtypes"),  # bf16 q over fp32 caches: no such engine
    (lambda c: dict(c, v_cache=c["v_cache"].bfloat16()), "dtypes"),  # K and V of different dtypes
    (lambda c: dict(c, v_cache=c["v_cache"][:, :, :, :32].contiguous()), "shapes"),
    (lambda c: dict(c, q=c["q"][:, :8]), "shapes"),
    (lambda c: dict(c, block_tables=c["block_tables"][:1]), "block_tables"),
    (lambda c: dict(c, k_cache=c["k_cache"].transpose(2, 3).contiguous().transpose(2, 3)), "contiguous"),
])
def test_launcher_checks_shapes_and_dtypes(change, match):
    q, k, v, ids, lens = make_case(2, 9, 3, 64, 16, [5, 6], torch.float32)
    case = dict(q=q, k_cache=k, v_cache=v, block_tables=ids, seq_lens=lens, scale=0.125)
    with pytest.raises(ValueError, match=match):
        cpu_decode_attention.decode_attention(**change(case))


def test_library_is_built_once_per_source_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("GENPOOL_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_build, "_loaded", {})
    assert cpu_build.load("cpu_decode_attention") is not None
    built = list((tmp_path / "kernels").glob("cpu_decode_attention-*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    monkeypatch.setattr(cpu_build, "_loaded", {})
    assert cpu_build.load("cpu_decode_attention") is not None
    assert built[0].stat().st_mtime_ns == mtime  # loaded, not rebuilt
    names = sorted(p.name.rsplit("-", 1)[0] for p in (tmp_path / "kernels").iterdir())
    assert names == ["cpu_decode_attention", "cpu_pool"]  # the kernel and the thread pool it links; no temp file


def test_no_compiler_means_torch_backend_for_auto_and_an_error_for_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("GENPOOL_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.delenv("GENPOOL_KERNEL_BACKEND", raising=False)
    monkeypatch.setattr(cpu_build, "_loaded", {})
    launchers = (cpu_decode_attention, cpu_gemm, cpu_prefill_attention, cpu_rms_norm, cpu_rotary, cpu_silu_mul,
                 cpu_write_kv)
    for launcher in launchers:  # forget the kernels found with a compiler, before and after
        launcher._kernel.cache_clear()
    monkeypatch.setattr(cpu_build, "_loaded", {})
    assert get_backend("auto", "cpu").name == "torch"
    with pytest.raises(RuntimeError, match="C compiler"):
        get_backend("cpu")
    for launcher in launchers:
        launcher._kernel.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t", [1, 7, 3000])  # 3000 rows: split over threads
def test_rotary_is_bit_identical_to_the_reference_on_fused_qkv_views(dtype, t):
    g = torch.Generator().manual_seed(t)
    qkv = torch.randn(t, 960, generator=g).to(dtype)
    q, k = qkv[:, :576].view(t, 9, 64), qkv[:, 576:768].view(t, 3, 64)  # strided rows, as the model has
    pos = torch.randint(0, 4096, (t,), generator=g)
    cos_sin = torch.randn(4096, 64, generator=g)
    want, got = ref.rotary(q, k, pos, cos_sin), cpu_rotary.rotary(q, k, pos, cos_sin)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[0].is_contiguous() and got[1].is_contiguous()


def test_rotary_refuses_positions_outside_its_table():
    q, k = torch.randn(2, 4, 8), torch.randn(2, 2, 8)
    with pytest.raises(ValueError, match="outside the rotary table"):
        cpu_rotary.rotary(q, k, torch.tensor([0, 16]), torch.randn(16, 8))
    with pytest.raises(ValueError, match="contiguous"):
        cpu_rotary.rotary(q.transpose(1, 2).contiguous().transpose(1, 2), k, torch.tensor([0, 1]), torch.randn(16, 8))


@pytest.mark.parametrize("t", [1, 5, 2048])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_fp32_matches_the_reference(t, with_residual):
    g = torch.Generator().manual_seed(t)
    x, res, w = torch.randn(t, 576, generator=g), torch.randn(t, 576, generator=g), torch.randn(576, generator=g)
    residual = res if with_residual else None
    want, got = ref.rms_norm(x, w, 1e-5, residual), cpu_rms_norm.rms_norm(x, w, 1e-5, residual)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=5e-7)


def test_rms_norm_bf16_rounds_where_the_reference_rounds():
    g = torch.Generator().manual_seed(9)
    x, res, w = (torch.randn(64, 576, generator=g).bfloat16(), torch.randn(64, 576, generator=g).bfloat16(),
                 torch.randn(576, generator=g).bfloat16())
    want, got = ref.rms_norm(x, w, 1e-6, res), cpu_rms_norm.rms_norm(x, w, 1e-6, res)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0].float(), want[0].float(), atol=0, rtol=2 ** -7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t", [1, 3, 2048])
def test_silu_and_mul_matches_the_reference(dtype, t):
    g = torch.Generator().manual_seed(t)
    x = (torch.randn(t, 2 * 1536, generator=g) * 4).to(dtype)
    x[0, :6] = torch.tensor([-100.0, -88.0, -20.0, 0.0, 20.0, 100.0]).to(dtype)  # exp's clamps
    want, got = ref.silu_and_mul(x), cpu_silu_mul.silu_and_mul(x)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-30, rtol=4e-7)
    else:
        torch.testing.assert_close(got.float(), want.float(), atol=1e-30, rtol=2 ** -7)


def test_silu_and_mul_checks_its_input():
    with pytest.raises(ValueError, match=r"\[T, 2I\]"):
        cpu_silu_mul.silu_and_mul(torch.randn(4, 7))
    with pytest.raises(ValueError, match=r"\[T, 2I\]"):
        cpu_silu_mul.silu_and_mul(torch.randn(4, 8, dtype=torch.float16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_write_kv_matches_the_reference_with_strided_rows_and_skipped_slots(dtype):
    qkv = torch.randn(7, (9 + 2 * 3) * 64).to(dtype)
    k = torch.randn(7, 3, 64).to(dtype)
    v = qkv[:, 12 * 64:].view(7, 3, 64)  # a view into the fused projection, rows 960 apart
    slots = torch.tensor([5, -1, 16, 17, 63, 0, -2])
    got = [torch.zeros(4, 16, 3, 64, dtype=dtype) for _ in range(2)]
    want = [c.clone() for c in got]
    cpu_write_kv.write_kv(k, v, *got, slots)
    ref.write_kv(k, v, *want, slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[0].view(-1, 3, 64)[63].equal(k[4]) and not got[0].view(-1, 3, 64)[1].any()


def test_write_kv_refuses_slots_outside_the_cache_and_falls_back_for_casts():
    k = v = torch.randn(2, 3, 64)
    cache = [torch.zeros(4, 16, 3, 64) for _ in range(2)]
    with pytest.raises(ValueError, match="outside the KV cache"):
        cpu_write_kv.write_kv(k, v, *cache, torch.tensor([3, 64]))
    assert not cache[0].any()  # checked before anything is written
    half = [torch.zeros(4, 16, 3, 64, dtype=torch.float16) for _ in range(2)]
    cpu_write_kv.write_kv(k, v, *half, torch.tensor([3, 9]))  # a cast the kernel does not do: the reference's
    assert torch.equal(half[0].view(-1, 3, 64)[9], k[1].half())


def test_write_kv_rounds_fp32_rows_into_a_bf16_cache_as_torch_does():
    """kv_cache_dtype bfloat16: the C kernel rounds each element to nearest even, as .bfloat16()."""
    qkv = torch.randn(5, 15 * 64) * 3
    k, v = torch.randn(5, 3, 64) * 100, qkv[:, 12 * 64:].view(5, 3, 64)
    k[0, 0, :4] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 3.0e38])  # ties, a large value
    slots = torch.tensor([2, -1, 17, 40, 0])
    got = [torch.zeros(4, 16, 3, 64, dtype=torch.bfloat16) for _ in range(2)]
    cpu_write_kv.write_kv(k, v, *got, slots)
    flat = [c.view(-1, 3, 64) for c in got]
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat[0][s], k[i].bfloat16()) and torch.equal(flat[1][s], v[i].bfloat16())
    assert not flat[0][1].any()
