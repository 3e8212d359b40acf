"""kernels/cpu/memory.py: weights on 2 MB pages (transparent huge pages advised per mapping)."""
from pathlib import Path

import pytest
import torch

from genpool.kernels import settings as kernel_settings_module
from genpool.kernels.cpu import gemm as cpu_gemm
from genpool.kernels.cpu import memory as cpu_memory

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str:
    try:
        return THP.read_text().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "unknown"


def huge_kb_at(addr: int) -> int:
    """AnonHugePages (kB) of the mapping holding addr, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(not cpu_memory.huge_pages_available(), reason="no MADV_HUGEPAGE here")
def test_weights_share_aligned_arenas_and_big_ones_start_on_a_huge_page():
    a = cpu_memory.weight_empty((3, 5))
    b = cpu_memory.weight_empty((100, 7))
    assert a.shape == (3, 5) and a.dtype == torch.float32 and a.is_contiguous()
    assert a.data_ptr() % 64 == 0 and b.data_ptr() % 64 == 0
    lo, hi = sorted([(a.data_ptr(), a.data_ptr() + 60), (b.data_ptr(), b.data_ptr() + 2800)])
    assert lo[1] <= hi[0]  # no overlap
    a.fill_(1.0), b.fill_(2.0)
    assert a.sum().item() == 15.0 and b.sum().item() == 1400.0
    big = cpu_memory.weight_empty((5 << 20,))  # 20 MB: a mapping of its own
    assert big.data_ptr() % cpu_memory.HUGE_PAGE == 0
    big.fill_(0.5)
    if thp_mode() in ("always", "madvise"):
        assert huge_kb_at(big.data_ptr()) >= 2048  # faulted in as 2 MB pages
    half = cpu_memory.weight_empty((4,), torch.bfloat16)
    assert half.dtype == torch.bfloat16 and half.data_ptr() % 64 == 0


def test_turned_off_it_is_plain_torch_memory(monkeypatch):
    monkeypatch.setattr(kernel_settings_module, "_current", None)  # the environment's, not an earlier engine's
    monkeypatch.setenv("GENPOOL_HUGE_PAGES", "0")
    assert not cpu_memory.huge_pages_available()
    t = cpu_memory.weight_empty((8, 3))
    assert t.shape == (8, 3) and t.untyped_storage().nbytes() == 8 * 3 * 4
    assert cpu_memory.weight_empty((0, 4)).shape == (0, 4)


def test_packed_weights_give_the_same_products_from_either_memory(monkeypatch):
    monkeypatch.setattr(kernel_settings_module, "_current", None)  # the environment's, not an earlier engine's
    w, x = torch.randn(96, 200), torch.randn(9, 96)
    on = cpu_gemm.PackedWeight(w)
    monkeypatch.setenv("GENPOOL_HUGE_PAGES", "0")
    off = cpu_gemm.PackedWeight(w)
    assert torch.equal(on.panels, off.panels)
    assert torch.equal(cpu_gemm.gemm(x, on), cpu_gemm.gemm(x, off))
