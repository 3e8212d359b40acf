"""kv_cache_dtype int8 (issue 34): kernels/kvq.py's rows (D int8 elements, then an fp32 scale per group
of 32), written by the C kernel with the reference's bits and read by decode and prefill attention
as (float)q * scale, so that each kernel over an int8 cache is that kernel over its fp32 widening,
bit for bit, and a prompt row is still decode attention's result for its position."""
from __future__ import annotations

import pytest
import torch

from genpool.kernels import kvq, ref
from genpool.kernels.cpu import decode_attention as cpu_decode_attention
from genpool.kernels.cpu import prefill_attention as cpu_prefill_attention
from genpool.kernels.cpu import write_kv as cpu_write_kv
from tests.kernels.test_kernels_cpu_prefill import _differing_from_decode, make
from tests.kv_cases import make_case

pytestmark = pytest.mark.skipif(not (cpu_write_kv.available() and cpu_decode_attention.available()),
                                reason="the CPU kernels could not be built")


def test_quantize_round_trips_within_half_a_step():
    x = torch.randn(7, 3, 64, generator=torch.Generator().manual_seed(0)) * 5
    x[0, 0] = 0  # an all-zero vector: scale 0, every element 0
    x[1, 1, :3] = torch.tensor([127.0, 63.5, -0.25])  # amax 127: scale 1, a tie rounds to even (64)
    rows = kvq.quantize(x)
    assert rows.shape == (7, 3, 72) and rows.dtype == torch.int8  # 64 elements, 2 scales
    back = kvq.widen(rows, torch.float32)
    step = x.view(7, 3, 2, 32).abs().amax(-1, keepdim=True).expand(7, 3, 2, 32).reshape(7, 3, 64) / 127
    assert bool(((back - x).abs() <= step / 2 * (1 + 1e-6)).all())
    assert not back[0, 0].any() and back[1, 1, 1].item() == 64.0
    assert int(rows[..., :64].abs().max()) == 127


def test_the_c_kernel_writes_the_references_rows():
    qkv = torch.randn(5, 15 * 64) * 3
    k, v = torch.randn(5, 3, 64) * 100, qkv[:, 12 * 64:].view(5, 3, 64)  # v: a view with a row stride
    k[2, 1] = 0
    slots = torch.tensor([2, -1, 17, 40, 0])
    got = [torch.zeros(4, 16, 3, 72, dtype=torch.int8) for _ in range(2)]
    want = [torch.zeros(4, 16, 3, 72, dtype=torch.int8) for _ in range(2)]
    cpu_write_kv.write_kv(k, v, *got, slots)
    ref.write_kv(k, v, *want, slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[0].view(-1, 3, 72)[2].any() and not got[0].view(-1, 3, 72)[1].any()


def test_the_c_kernel_and_the_reference_round_alike_where_a_reciprocal_would_not():
    """127 / amax is one division on both sides: torch's `127 / tensor` is a reciprocal and a
    product, two roundings, which made 1 element in ~1.3M differ from the kernel's (this pair)."""
    amax, x = float.fromhex("0x1.ec4d4ep+2"), float.fromhex("0x1.74223ep-4")
    k = torch.zeros(1, 1, 32)
    k[0, 0, 0], k[0, 0, 1] = amax, x
    got = [torch.zeros(1, 16, 1, 36, dtype=torch.int8) for _ in range(2)]
    cpu_write_kv.write_kv(k, k, *got, torch.tensor([0]))
    want = kvq.quantize(k)
    assert int(want[0, 0, 1]) == int(got[0][0, 0, 0, 1]) == 1
    assert torch.equal(got[0][0, 0], want[0])


def test_degenerate_groups_quantize_to_zeros_not_to_undefined_casts():
    """A group whose 127 / max|x| overflows (max|x| ~1e-38) or is 0 (an inf in it): the elements
    are 0, on both sides, not a cast of NaN (undefined in C)."""
    k = torch.zeros(1, 1, 64)
    k[0, 0, :3] = torch.tensor([1e-38, -5e-39, 0.0])
    k[0, 0, 32:34] = torch.tensor([float("inf"), 1.0])
    got = [torch.zeros(1, 16, 1, 72, dtype=torch.int8) for _ in range(2)]
    cpu_write_kv.write_kv(k, k, *got, torch.tensor([0]))
    want = kvq.quantize(k)
    assert torch.equal(got[0][0, 0], want[0])
    assert not want[0, 0, :64].any()


def test_int8_rows_are_refused_as_values_to_copy():
    with pytest.raises(ValueError, match="slot"):  # a float32 row into an int8 cache, outside it
        cpu_write_kv.write_kv(torch.ones(1, 3, 64), torch.ones(1, 3, 64),
                              *[torch.zeros(1, 16, 3, 72, dtype=torch.int8) for _ in range(2)], torch.tensor([16]))


@pytest.mark.parametrize("lens", [[1, 15, 16, 100, 333, 64], list(range(20, 820, 20))])
@pytest.mark.parametrize("d", [64, 32, 48])  # 64: the AVX-512 loops; else the widened blocks (48: a short group)
def test_decode_attention_over_int8_is_its_widenings_bits(lens, d):
    q, k, v, ids, lens_t = make_case(len(lens), 9, 3, d, 16, lens, torch.float32, seed=2)
    kq, vq = kvq.quantize(k), kvq.quantize(v)
    got = cpu_decode_attention.decode_attention(q, kq, vq, ids, lens_t, 0.125)
    kw, vw = kvq.widen(kq, torch.float32), kvq.widen(vq, torch.float32)
    assert torch.equal(got, cpu_decode_attention.decode_attention(q, kw, vw, ids, lens_t, 0.125))
    torch.testing.assert_close(got, ref._decode_rows(q, kq, vq, ids, lens_t, 0.125), atol=2e-5, rtol=2e-5)
    exact = ref._decode_rows(q, k, v, ids, lens_t, 0.125)  # the quantization's own error: small
    assert float((got - exact).abs().max()) < 0.05 * float(exact.abs().max())


def test_decode_attention_refuses_int8_under_bf16_queries():
    q, k, v, ids, lens_t = make_case(2, 9, 3, 64, 16, [5, 9], torch.float32, seed=2)
    with pytest.raises(ValueError, match="int8"):
        cpu_decode_attention.decode_attention(q.bfloat16(), kvq.quantize(k), kvq.quantize(v), ids, lens_t, 0.125)


@pytest.mark.parametrize("seqs", [[(37, 37), (17, 40)], [(200, 700)]])
@pytest.mark.parametrize("d", [64, 48])
def test_prefill_over_int8_is_its_widenings_bits(seqs, d):
    q, k, v, tables, starts, qls, kvls = make(seqs, 9, 3, d, 16, seed=5)
    kq, vq = kvq.quantize(k), kvq.quantize(v)
    assert cpu_prefill_attention.supports(q, kq)
    got, want, ref_out = torch.zeros_like(q), torch.zeros_like(q), torch.zeros_like(q)
    cpu_prefill_attention.prefill_rows(q, kq, vq, tables, starts, qls, kvls, 0.125, got)
    cpu_prefill_attention.prefill_rows(q, kvq.widen(kq, torch.float32), kvq.widen(vq, torch.float32), tables,
                                       starts, qls, kvls, 0.125, want)
    assert torch.equal(got, want)
    ref.prefill_rows(q, kq, vq, tables, starts, qls, kvls, 0.125, ref_out)
    torch.testing.assert_close(got, ref_out, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("d,kv", [(64, 77), (64, 1100), (32, 53), (48, 40)])
def test_each_prompt_row_is_decodes_bits_over_int8(d, kv):
    """A resumed or recomputed sequence prefills what was decoded one by one: same bits."""
    q, k, v, tables, _, _, _ = make([(kv, kv)], 9, 3, d, 16, seed=3, gap=0)
    kq, vq = kvq.quantize(k), kvq.quantize(v)
    rows = torch.empty_like(q)
    cpu_prefill_attention.prefill_rows(q, kq, vq, tables, [0], [kv], [kv], d ** -0.5, rows)
    pos = sorted({0, 1, 15, 16, 17, kv // 2, kv - 1} | ({511, 512, 513} if kv > 513 else set()))
    bad = _differing_from_decode(q, kq, vq, tables[0], rows, 0, 0, pos, d)
    assert not bad, f"positions whose prefill row differs from decode attention: {bad}"
