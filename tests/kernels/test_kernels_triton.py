"""Triton kernels against the torch reference (kernels/ref.py).

On the CPU (CI) the kernels run under Triton's interpreter, ~1 ms per program instance, so the
shapes here are deliberately tiny. GENPOOL_TEST_DEVICE=cuda runs the same tests compiled on a GPU.

Tolerances (atol, rtol) per dtype. Attention is compared with the fp32 reference over the same
(rounded) inputs; bf16/fp16 error comes from rounding P and the output to 8/11 mantissa bits.
RMSNorm and rotary are compared with the reference run in the same dtype (<= 1-2 ulp apart).
KV writes are copies and must match exactly.

| dtype    | atol  | rtol  |
|----------|-------|-------|
| float32  | 2e-5  | 2e-5  |
| float16  | 4e-3  | 4e-3  |
| bfloat16 | 3e-2  | 3e-2  |
"""
from tests.triton_interp import DEVICE  # noqa: I001 (first: sets TRITON_INTERPRET=1 on the CPU)

import pytest  # noqa: E402
import torch  # noqa: E402

from genpool.kernels import ref  # noqa: E402
from genpool.kernels.triton.backend import build_backend  # noqa: E402
from genpool.kernels.triton.kv_write import write_kv  # noqa: E402
from genpool.kernels.triton.paged_attention import paged_attention  # noqa: E402
from genpool.kernels.triton.rms_norm import rms_norm  # noqa: E402
from genpool.kernels.triton.rotary import rotary  # noqa: E402

TOL = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}
DTYPES = list(TOL)
# Triton 3.9's interpreter casts fp32 -> bf16 by truncation, not round-to-nearest-even as GPUs
# do, so an interpreted bf16 result can be 1 ulp off a torch one even where the GPU is exact.
INTERPRETED_BF16_TRUNCATES = DEVICE == "cpu"
DTYPE_IDS = ["fp32", "fp16", "bf16"]


def assert_close(actual, expected, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)


def make_batch(q_lens, kv_lens, num_q_heads, num_kv_heads, head_dim, block_size, num_blocks,
               dtype, seed=0):
    """Random paged cache + randomly scattered (non-contiguous, unsorted) block tables."""
    g = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-n // block_size) for n in kv_lens]
    max_blocks = max(blocks_needed) + 2  # spare columns hold junk ids the kernel must not read
    ids = torch.randperm(num_blocks, generator=g)[: len(kv_lens) * max_blocks]
    tables = ids.view(len(kv_lens), max_blocks).to(torch.int32)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=g)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    seq_lens = torch.tensor(kv_lens, dtype=torch.int32)
    to = dict(device=DEVICE)
    return (q.to(dtype=dtype, **to), k_cache.to(dtype=dtype, **to), v_cache.to(dtype=dtype, **to),
            tables.to(**to), qsl.to(**to), seq_lens.to(**to))


def check_attention(q_lens, kv_lens, num_q_heads, num_kv_heads, dtype, head_dim=16,
                    block_size=16, num_blocks=64, **kwargs):
    args = make_batch(q_lens, kv_lens, num_q_heads, num_kv_heads, head_dim, block_size,
                      num_blocks, dtype)
    scale = head_dim ** -0.5
    out = paged_attention(*args, scale, **kwargs)
    assert out.shape == args[0].shape and out.dtype == dtype
    expected = ref.paged_attention(*[a.cpu().float() if a.is_floating_point() else a.cpu()
                                     for a in args], scale)
    assert_close(out, expected, dtype)


# (q_lens, kv_lens): decode rows, 1-token prompts, whole prompts, kv_len a multiple of the block
# size, and short chunks after long cached prefixes, all in one flattened batch.
MIXED = ([1, 1, 5, 16, 3, 1, 2], [1, 37, 5, 16, 50, 32, 64])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (3, 1), (8, 1)], ids=["mha", "gqa3", "gqa8"])
def test_attention_mixed_batch(dtype, num_q_heads, num_kv_heads):
    check_attention(*MIXED, num_q_heads, num_kv_heads, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_attention_decode_only(dtype):
    # avg q_len 1 takes the small-tile path; 6 q heads over 2 kv heads pads the group to 4.
    check_attention([1, 1, 1, 1], [1, 16, 33, 70], 6, 2, dtype)


def test_attention_prefill_chunks_cross_tiles():
    # 40 query tokens span several 16-token tiles (gqa 1 -> 64 tokens per tile would be one).
    # The empty middle sequence owns one surplus tile that must exit without writing.
    check_attention([40, 0, 2], [90, 5, 2], 4, 1, torch.float32)


def test_attention_large_num_blocks_few_used():
    check_attention([1, 4], [20, 30], 3, 3, torch.float16, num_blocks=20_000)


@pytest.mark.parametrize("block_size,block_n", [(8, 16), (32, 32), (16, 32), (64, 16)])
def test_attention_block_sizes(block_size, block_n):
    check_attention([2, 1, 3], [19, 64, 40], 4, 2, torch.float32, block_size=block_size,
                    block_n=block_n)


def test_attention_head_dim_32_and_non_power_of_two():
    check_attention([3, 1], [21, 9], 4, 2, torch.float32, head_dim=32)
    check_attention([3, 1], [21, 9], 4, 2, torch.bfloat16, head_dim=24)


def test_attention_matches_naive_after_write_kv():
    """End to end without the reference: write K/V through the slot mapping, then attend, and
    compare with dense causal attention over the unpaged K/V."""
    g = torch.Generator().manual_seed(1)
    q_lens, kv_lens, hq, hkv, d, bs = [3, 1], [5, 18], 4, 2, 16, 4
    k_cache = torch.zeros(32, bs, hkv, d, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.randperm(32, generator=g)[:10].view(2, 5).to(torch.int32)
    k = [torch.randn(n, hkv, d, generator=g) for n in kv_lens]
    v = [torch.randn(n, hkv, d, generator=g) for n in kv_lens]
    slots = torch.cat([tables[i, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
                       for i, n in enumerate(kv_lens)])
    write_kv(torch.cat(k).to(DEVICE), torch.cat(v).to(DEVICE), k_cache, v_cache, slots.to(DEVICE))
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    qsl = torch.tensor([0, 3, 4], dtype=torch.int32)
    out = paged_attention(q.to(DEVICE), k_cache, v_cache, tables.to(DEVICE), qsl.to(DEVICE),
                          torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE), d ** -0.5).cpu()
    for i, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        qi = q[qsl[i]:qsl[i + 1]].transpose(0, 1)  # [hq, ql, d]
        ki = k[i].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        vi = v[i].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        scores = qi @ ki.transpose(1, 2) * d ** -0.5
        visible = torch.arange(kl)[None, :] <= torch.arange(kl - ql, kl)[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        assert_close(out[qsl[i]:qsl[i + 1]], (probs @ vi).transpose(0, 1), torch.float32)


def test_attention_rejects_bad_inputs():
    args = list(make_batch([2, 1], [4, 9], 4, 2, 16, 16, 8, torch.float32))
    bad = {
        0: args[0][:, :3],  # 3 q heads over 2 kv heads
        1: args[1].half(),  # dtype mismatch
        3: args[3].long(),  # block tables not int32
        4: args[4][:2],  # query_start_loc length
        5: args[5].float(),  # seq_lens dtype
    }
    for idx, value in bad.items():
        broken = list(args)
        broken[idx] = value
        with pytest.raises(ValueError):
            paged_attention(*broken, 0.25)
    with pytest.raises(ValueError, match="contiguous"):
        paged_attention(args[0].transpose(1, 2).contiguous().transpose(1, 2), *args[1:], 0.25)
    with pytest.raises(ValueError, match="is on"):
        paged_attention(args[0], *args[1:5], args[5].to("meta"), 0.25)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_write_kv_matches_reference(dtype):
    g = torch.Generator().manual_seed(2)
    hkv, d, bs, num_blocks = 3, 16, 16, 4096
    qkv = torch.randn(6, 8 * d, generator=g).to(DEVICE, dtype)  # fused projection output
    k = qkv[:, 2 * d:5 * d].view(6, hkv, d)  # strided views, as the engine slices them
    v = qkv[:, 5 * d:8 * d].view(6, hkv, d)
    slots = torch.tensor([0, -1, 17, 4095 * bs + 15, -1, 31], device=DEVICE)
    caches = [torch.randn(num_blocks, bs, hkv, d, generator=g).to(DEVICE, dtype) for _ in range(2)]
    expected = [c.clone() for c in caches]
    write_kv(k, v, *caches, slots)
    ref.write_kv(k, v, *expected, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


def test_write_kv_rejects_bad_inputs():
    k = torch.randn(2, 2, 16, device=DEVICE)
    cache = torch.zeros(4, 16, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="int64"):
        write_kv(k, k, cache, cache, torch.tensor([0, 1], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="heads/dim"):
        write_kv(k, k, cache[:, :, :1], cache[:, :, :1], torch.tensor([0, 1], device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("hidden", [64, 100])
def test_rms_norm_matches_reference(dtype, with_residual, hidden):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5, hidden, generator=g) * 3).to(DEVICE, dtype)
    weight = torch.rand(hidden, generator=g).to(DEVICE, dtype) + 0.5
    residual = torch.randn(5, hidden, generator=g).to(DEVICE, dtype) if with_residual else None
    out, new_res = rms_norm(x, weight, 1e-5, residual)
    exp_out, exp_res = ref.rms_norm(x, weight, 1e-5, residual)
    assert out.dtype == exp_out.dtype and new_res.dtype == exp_res.dtype
    assert_close(out, exp_out, dtype)
    if INTERPRETED_BF16_TRUNCATES and dtype == torch.bfloat16:
        assert_close(new_res, exp_res, dtype)
    else:
        assert torch.equal(new_res.cpu(), exp_res.cpu())


def test_rms_norm_fp32_weight_with_bf16_input_promotes_like_reference():
    x = torch.randn(3, 32).to(DEVICE, torch.bfloat16)
    weight = torch.rand(32, device=DEVICE) + 0.5
    out, _ = rms_norm(x, weight, 1e-6)
    exp_out, _ = ref.rms_norm(x, weight, 1e-6)
    assert out.dtype == exp_out.dtype == torch.float32
    # The normalised row is rounded to bf16 before the fp32 weight: 1 ulp under the interpreter.
    assert_close(out, exp_out, torch.bfloat16 if INTERPRETED_BF16_TRUNCATES else torch.float32)


def test_rms_norm_rejects_bad_inputs():
    x = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(4, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, torch.ones(8, device=DEVICE), 1e-5, torch.randn(2, 4, device=DEVICE))


def cos_sin_table(max_pos, head_dim, theta=10000.0):
    inv = theta ** (-torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.arange(max_pos).float()[:, None] * inv[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(3, 1, 32), (8, 8, 16), (6, 2, 20)])
def test_rotary_matches_reference_in_place(dtype, num_q_heads, num_kv_heads, head_dim):
    g = torch.Generator().manual_seed(4)
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(5, width, generator=g).to(DEVICE, dtype)
    q = qkv[:, :num_q_heads * head_dim].view(5, num_q_heads, head_dim)
    k = qkv[:, num_q_heads * head_dim:(num_q_heads + num_kv_heads) * head_dim].view(5, num_kv_heads, head_dim)
    positions = torch.tensor([0, 7, 3, 127, 64], device=DEVICE)
    cos_sin = cos_sin_table(128, head_dim).to(DEVICE)
    exp_q, exp_k = ref.rotary(q.clone(), k.clone(), positions, cos_sin)
    v_before = qkv[:, (num_q_heads + num_kv_heads) * head_dim:].clone()
    out_q, out_k = rotary(q, k, positions, cos_sin)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    assert_close(q, exp_q, dtype)
    assert_close(k, exp_k, dtype)
    assert torch.equal(qkv[:, (num_q_heads + num_kv_heads) * head_dim:], v_before)  # V untouched


def test_rotary_rejects_bad_inputs():
    q = torch.randn(2, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="positions"):
        rotary(q, q, torch.tensor([0, 1], dtype=torch.int32, device=DEVICE), cos_sin_table(4, 16).to(DEVICE))
    with pytest.raises(ValueError, match="cos_sin"):
        rotary(q, q, torch.tensor([0, 1], device=DEVICE), cos_sin_table(4, 8).to(DEVICE))


def test_backend_exposes_the_contract():
    backend = build_backend()
    assert backend.name == "triton"
    assert backend.paged_attention is paged_attention and backend.write_kv is write_kv
    assert backend.rms_norm is rms_norm and backend.rotary is rotary
