"""kernels/triton/qgemm.py against the reference (x @ dequantized W^T), under Triton's interpreter on
the CPU at small sizes (GENPOOL_TEST_DEVICE=cuda: compiled, on a GPU)."""
import importlib.util
import os

import pytest

DEVICE = os.environ.get("GENPOOL_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before the first import of the @triton.jit definitions
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install genpool[triton])", allow_module_level=True)

import torch  # noqa: E402

from genpool.engine.models.quant import quantize_int8  # noqa: E402
from genpool.kernels.qtensor import QTensor, pack_nibbles  # noqa: E402

if DEVICE.startswith("cuda") and not torch.cuda.is_available():
    pytest.skip(f"GENPOOL_TEST_DEVICE={DEVICE} but CUDA is not available", allow_module_level=True)


def _module():
    import importlib
    import sys
    name = "genpool.kernels.triton.qgemm"
    if name in sys.modules:  # imported earlier without the interpreter flag: re-run its decorators
        return importlib.reload(sys.modules[name])
    return importlib.import_module(name)


def _to(w: QTensor, dev) -> QTensor:
    off = None if w.offset is None else w.offset.to(dev)
    return QTensor(w.q.to(dev), w.scale.to(dev), off, w.bits, w.group, w.shape, w.fmt)


@pytest.mark.parametrize("kind", ["int8", "q4_1", "awq-g64"])
@pytest.mark.parametrize("m", [1, 5])
def test_triton_qgemm_matches_the_dequantized_product(kind, m):
    tq = _module()
    torch.manual_seed(m)
    n, k = 40, 128
    if kind == "int8":
        w = quantize_int8(torch.randn(n, k))
    else:
        g = 32 if kind == "q4_1" else 64
        w = QTensor(pack_nibbles(torch.randint(0, 16, (n, k))), torch.rand(n, k // g).half().float() * 0.1,
                    torch.randn(n, k // g).half().float() * 0.1, 4, g, (n, k), kind)
    bias = torch.randn(n)
    x = torch.randn(m, k)
    want = x @ w.dequantize().t() + bias
    got = tq.qlinear(x.to(DEVICE), _to(w, DEVICE), bias.to(DEVICE)).cpu()
    torch.testing.assert_close(got, want, rtol=2e-3 if DEVICE != "cpu" else 1e-5,
                               atol=2e-3 if DEVICE != "cpu" else 1e-5)  # tf32 dot on a GPU
