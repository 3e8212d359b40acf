"""The C kernels' thread pool (kernels/cpu/cpu_pool.c): every range of a call runs once, whichever
thread runs it; callers on several threads at once each get their own call's results; a forked
child gets a pool of its own. SwiGLU is elementwise, so any split of its rows gives the same bits
as one thread does."""
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from genpool.kernels.cpu import silu_mul as cpu_silu_mul

pytestmark = pytest.mark.skipif(not cpu_silu_mul.available(), reason="no C compiler here")

ROWS, INTER = 256, 512  # 256 x 1536 elements of work: the kernel splits it over the threads


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _one_thread(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [cpu_silu_mul.silu_and_mul(x) for x in xs]
    finally:
        torch.set_num_threads(before)


def test_a_call_on_the_pool_gives_the_bits_of_one_thread(two_threads):
    xs = [torch.randn(rows, 2 * INTER) for rows in (ROWS, ROWS + 3, 7)]  # 7 rows: below the split size
    want = _one_thread(xs)
    for x, w in zip(xs, want):
        assert torch.equal(cpu_silu_mul.silu_and_mul(x), w)


def test_callers_on_several_threads_at_once_each_get_their_own_results(two_threads):
    gen = torch.Generator().manual_seed(0)
    inputs = [[torch.randn(ROWS, 2 * INTER, generator=gen) for _ in range(15)] for _ in range(4)]
    want = [_one_thread(xs) for xs in inputs]
    got: list[list[torch.Tensor]] = [[] for _ in inputs]

    def run(i: int) -> None:
        got[i] = [cpu_silu_mul.silu_and_mul(x) for x in inputs[i]]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    for w, g in zip(want, got):
        assert len(g) == len(w) and all(torch.equal(a, b) for a, b in zip(g, w))


def test_a_forked_child_runs_kernels_on_a_pool_of_its_own():
    # The parent's pool threads do not exist in a fork's child: a pool that believed they did would
    # hand them ranges nobody runs (a hang) or run with fewer threads forever.
    script = textwrap.dedent(f"""
        import os, torch
        from genpool.kernels.cpu import silu_mul
        torch.set_num_threads(2)
        x = torch.randn({ROWS}, {2 * INTER})
        want = silu_mul.silu_and_mul(x)  # the parent's pool starts its thread here
        pid = os.fork()
        if pid == 0:
            ok = all(torch.equal(silu_mul.silu_and_mul(x), want) for _ in range(20))
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        assert torch.equal(silu_mul.silu_and_mul(x), want)  # and the parent's pool still serves
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
