"""kernels/cpu/cpu_prefill_attention.c against the reference (one SDPA per sequence over gathered K/V).

Each row is also decode attention's result for its position, bit for bit.
Cases: whole prompts (q_len == kv_len) and chunks after cached positions (q_len < kv_len), lengths
around panel and block edges, block sizes smaller than, equal to and larger than the 16-token
panel (and not a multiple of it), GQA and no GQA, head sizes 64 and 128, several sequences in one
call with other rows between them (which must be left alone). fp32 within 2e-5 of the reference.
"""
import pytest
import torch

from genpool.kernels import get_backend, ref
from genpool.kernels.cpu import prefill_attention as cpu_prefill_attention
from tests.kv_cases import make_case

pytestmark = pytest.mark.skipif(not cpu_prefill_attention.available(), reason="no C compiler here")


def make(seqs, hq, hkv, d, bs, seed=0, gap=2):
    """seqs: [(q_len, kv_len)] -> q [T, Hq, D] with `gap` unrelated rows before each sequence."""
    _, k, v, tables, _ = make_case(len(seqs), hq, hkv, d, bs, [kv for _, kv in seqs], torch.float32, seed)
    starts, t = [], 0
    for ql, _ in seqs:
        starts.append(t + gap)
        t += gap + ql
    q = torch.randn(t, hq, d, generator=torch.Generator().manual_seed(seed + 1))
    return q, k, v, tables, starts, [s[0] for s in seqs], [s[1] for s in seqs]


@pytest.mark.parametrize("seqs,hq,hkv,d,bs", [
    ([(2, 2)], 9, 3, 64, 16),                      # the smallest prefill: two tokens
    ([(37, 37), (16, 16), (17, 40)], 9, 3, 64, 16),     # prompts and a chunk after 23 cached tokens
    ([(50, 50), (20, 333)], 4, 4, 64, 8),               # no GQA, blocks smaller than a panel
    ([(33, 70), (64, 64)], 8, 2, 128, 32),              # head_dim 128, blocks of two panels
    ([(45, 45), (30, 61)], 6, 3, 64, 24),               # blocks not a multiple of the panel
    ([(200, 700)], 9, 3, 64, 16),                       # a long chunk, several threads
])
def test_prefill_matches_reference(seqs, hq, hkv, d, bs):
    q, k, v, tables, starts, qls, kvls = make(seqs, hq, hkv, d, bs)
    sentinel = float("nan")
    got, want = torch.full_like(q, sentinel), torch.full_like(q, sentinel)
    cpu_prefill_attention.prefill_rows(q, k, v, tables, starts, qls, kvls, d ** -0.5, got)
    ref.prefill_rows(q, k, v, tables, starts, qls, kvls, d ** -0.5, want)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5, equal_nan=True)  # NaN rows: untouched


@pytest.mark.parametrize("ql", [20, 9])  # a prompt, a chunk after 11 cached positions
def test_garbage_past_the_sequence_does_not_reach_the_output(ql):
    q, k, v, tables, starts, qls, kvls = make([(ql, 20)], 9, 3, 64, 16)
    want = torch.empty_like(q)
    cpu_prefill_attention.prefill_rows(q, k, v, tables, starts, qls, kvls, 0.125, want)
    for cache in (k, v):  # positions 20..31 of the second block hold NaN, as a fresh cache may
        cache[tables[0, 1], 4:] = float("nan")
    got = torch.empty_like(q)
    cpu_prefill_attention.prefill_rows(q, k, v, tables, starts, qls, kvls, 0.125, got)
    assert torch.equal(got[2:], want[2:])


def test_rows_do_not_depend_on_the_batch_the_chunking_or_threads():
    """A prompt attended whole, in two chunks, next to another sequence, on one thread: the same bits."""
    q, k, v, tables, starts, qls, kvls = make([(300, 300), (40, 40)], 9, 3, 64, 16, gap=0)
    whole = torch.empty_like(q)
    cpu_prefill_attention.prefill_rows(q, k, v, tables, starts, qls, kvls, 0.125, whole)
    alone = torch.empty_like(q)
    cpu_prefill_attention.prefill_rows(q, k, v, tables[:1], [0], [300], [300], 0.125, alone)
    assert torch.equal(alone[:300], whole[:300])
    chunks = torch.empty_like(q)
    cpu_prefill_attention.prefill_rows(q, k, v, tables[:1], [0], [133], [133], 0.125, chunks)
    cpu_prefill_attention.prefill_rows(q, k, v, tables[:1], [133], [167], [300], 0.125, chunks)
    assert torch.equal(chunks[:300], whole[:300])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.empty_like(q)
        cpu_prefill_attention.prefill_rows(q, k, v, tables, starts, qls, kvls, 0.125, one)
        assert torch.equal(one, whole)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("cut", [511, 512, 513, 700])
def test_prompts_longer_than_a_key_chunk_do_not_depend_on_the_chunking(cut):
    """1100 keys span three 512-key chunks (the running softmax rescales between them): the prompt
    attended whole equals the same prompt in two chunks cut around a chunk edge, bit for bit, and
    the reference within fp32 tolerance."""
    q, k, v, tables, _, _, _ = make([(1100, 1100)], 9, 3, 64, 16, gap=0)
    whole, chunks, want = torch.empty_like(q), torch.empty_like(q), torch.empty_like(q)
    cpu_prefill_attention.prefill_rows(q, k, v, tables, [0], [1100], [1100], 0.125, whole)
    cpu_prefill_attention.prefill_rows(q, k, v, tables, [0], [cut], [cut], 0.125, chunks)
    cpu_prefill_attention.prefill_rows(q, k, v, tables, [cut], [1100 - cut], [1100], 0.125, chunks)
    assert torch.equal(chunks, whole)
    ref.prefill_rows(q, k, v, tables, [0], [1100], [1100], 0.125, want)
    torch.testing.assert_close(whole, want, rtol=1e-4, atol=2e-5)


def test_errors_and_fallbacks():
    q, k, v, tables, starts, qls, kvls = make([(20, 20)], 9, 3, 64, 16)
    out = torch.empty_like(q)
    bad = tables.clone()
    bad[0, 1] = k.shape[0] + 7
    with pytest.raises(RuntimeError, match="block id out of range"):
        cpu_prefill_attention.prefill_rows(q, k, v, bad, starts, qls, kvls, 0.125, out)
    with pytest.raises(RuntimeError, match="lengths"):
        cpu_prefill_attention.prefill_rows(q, k, v, tables, starts, qls, [10_000], 0.125, out)
    with pytest.raises(ValueError, match="outside q"):
        cpu_prefill_attention.prefill_rows(q, k, v, tables, [15], qls, kvls, 0.125, out)
    with pytest.raises(ValueError, match="float32"):
        cpu_prefill_attention.prefill_rows(q, k, v, tables, starts, qls, kvls, 0.125, out.bfloat16())
    # bf16, head sizes the tiles do not cover, and more than 64 query heads per kv head go to the
    # reference (the C kernel would refuse them): same bits as the reference
    cases = [(q.bfloat16(), k.bfloat16(), v.bfloat16(), tables, starts, qls, kvls),
             make([(20, 20)], 6, 3, 40, 16), make([(5, 5)], 66, 1, 16, 16)]
    for qs, ks, vs, tab, st, ql, kvl in cases:
        got, want = torch.empty_like(qs), torch.empty_like(qs)
        cpu_prefill_attention.prefill_rows(qs, ks, vs, tab, st, ql, kvl, 0.125, got)
        ref.prefill_rows(qs, ks, vs, tab, st, ql, kvl, 0.125, want)
        assert torch.equal(got[2:], want[2:])


def test_backend_routes_a_mixed_batch(monkeypatch):
    """Decode rows, a prompt and a chunk in one flattened batch: the cpu backend's paged_attention
    equals the torch reference's."""
    monkeypatch.setenv("GENPOOL_CPU_GEMM", "1")  # the C prefill kernel, even on an AVX-512 CPU
    assert get_backend("cpu").paged_attention.keywords["prefill"] is cpu_prefill_attention.prefill_rows
    q, k, v, tables, _, _, _ = make([(1, 30), (25, 25), (1, 100), (12, 50)], 9, 3, 64, 16, gap=0)
    qsl = torch.tensor([0, 1, 26, 27, 39], dtype=torch.int32)
    lens = torch.tensor([30, 25, 100, 50], dtype=torch.int32)
    got = get_backend("cpu").paged_attention(q, k, v, tables, qsl, lens, 0.125)
    want = ref.paged_attention(q, k, v, tables, qsl, lens, 0.125)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("seqs", [[(37, 37), (17, 40)], [(200, 700)]])
def test_bf16_caches_give_the_bits_of_their_fp32_widening(seqs):
    """kv_cache_dtype bfloat16: the kernel widens K/V exactly while packing, so fp32 q over bf16
    caches is the fp32 kernel over those caches widened to fp32, bit for bit."""
    q, k, v, tables, starts, qls, kvls = make(seqs, 9, 3, 64, 16, seed=5)
    kb, vb = k.bfloat16(), v.bfloat16()
    assert cpu_prefill_attention.supports(q, kb)
    got, want = torch.zeros_like(q), torch.zeros_like(q)
    cpu_prefill_attention.prefill_rows(q, kb, vb, tables, starts, qls, kvls, 0.125, got)
    cpu_prefill_attention.prefill_rows(q, kb.float(), vb.float(), tables, starts, qls, kvls, 0.125, want)
    assert torch.equal(got, want)
    ref_out = torch.zeros_like(q)  # the reference widens the gathered K/V to q's dtype
    ref.prefill_rows(q, kb, vb, tables, starts, qls, kvls, 0.125, ref_out)
    torch.testing.assert_close(got, ref_out, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("hq,hkv,d,bs,kv", [
    (4, 2, 16, 16, 40),     # the tiny test model's heads
    (9, 3, 64, 16, 77),     # SmolLM2's
    (6, 3, 32, 24, 53),     # blocks not a multiple of 8 tokens
    (8, 2, 128, 32, 45),
    (9, 3, 64, 16, 1100),   # past the 512-key chunk
])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_each_row_is_the_decode_kernels_bits(hq, hkv, d, bs, kv, kv_dtype):
    """A prompt's row at position p equals decode attention's result for one query over p + 1 keys,
    bit for bit: a resumed (or preempted and recomputed) sequence prefills positions an earlier
    run decoded one by one, and its KV must come out the same for the continuation to be exact."""
    q, k, v, tables, _, _, _ = make([(kv, kv)], hq, hkv, d, bs, seed=3, gap=0)
    k, v = k.to(kv_dtype), v.to(kv_dtype)
    rows = torch.empty_like(q)
    cpu_prefill_attention.prefill_rows(q, k, v, tables, [0], [kv], [kv], d ** -0.5, rows)
    pos = sorted({0, 1, 7, 8, 9, 15, 16, 17, kv // 2, kv - 2, kv - 1} | ({511, 512, 513} if kv > 513 else set()))
    bad = _differing_from_decode(q, k, v, tables[0], rows, 0, 0, pos, d)
    assert not bad, f"positions whose prefill row differs from decode attention: {bad}"


def _differing_from_decode(q, k, v, table, rows, start, first_pos, positions, d) -> list[int]:
    """The positions whose prefill row (rows[start + p - first_pos]) is not decode attention's
    result for one query over p + 1 keys, bit for bit."""
    from genpool.kernels.cpu.decode_attention import decode_attention
    idx = [start + p - first_pos for p in positions]
    one = decode_attention(q[idx], k, v, table.expand(len(idx), -1), torch.tensor(positions) + 1, d ** -0.5)
    return [p for i, p in enumerate(positions) if not torch.equal(one[i], rows[idx[i]])]


@pytest.mark.parametrize("hq,hkv,d,bs", [(9, 3, 64, 16), (4, 2, 16, 16), (6, 2, 32, 3)])
def test_chunks_of_several_sequences_are_the_decode_kernels_bits(hq, hkv, d, bs):
    """The same for chunks after cached positions (q_len < kv_len), several sequences in one call
    with rows between them, blocks smaller than a group of tokens: every row of every sequence."""
    seqs = [(17, 40), (30, 30), (5, 70)]
    q, k, v, tables, starts, qls, kvls = make(seqs, hq, hkv, d, bs, seed=7)
    rows = torch.empty_like(q)
    cpu_prefill_attention.prefill_rows(q, k, v, tables, starts, qls, kvls, d ** -0.5, rows)
    for i, (ql, kv) in enumerate(seqs):
        bad = _differing_from_decode(q, k, v, tables[i], rows, starts[i], kv - ql, list(range(kv - ql, kv)), d)
        assert not bad, f"sequence {i}: positions whose prefill row differs from decode attention: {bad}"
