"""Random paged-KV cases shared by the CPU kernel tests."""
import torch


def make_case(rows, hq, hkv, d, bs, lens, dtype, seed=0, num_blocks=None):
    g = torch.Generator().manual_seed(seed)
    width = max((n + bs - 1) // bs for n in lens)
    num_blocks = num_blocks or rows * width + 3
    k = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    v = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    # Shuffled, non-contiguous block ids, as a long-running cache hands them out.
    ids = torch.randperm(num_blocks, generator=g)[:rows * width].view(rows, width).to(torch.int32)
    q = torch.randn(rows, hq, d, generator=g).to(dtype)
    return q, k, v, ids, torch.tensor(lens, dtype=torch.int32)
