"""Run Triton kernels on the CPU for tests: TRITON_INTERPRET=1 before the @triton.jit definitions.

Import this module before triton or kernels.triton_* (it is a no-op with GENPOOL_TEST_DEVICE=cuda).
"""
import importlib
import importlib.util
import os
import sys

import pytest

DEVICE = os.environ.get("GENPOOL_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    # Must precede the first import of triton and of the @triton.jit definitions.
    os.environ["TRITON_INTERPRET"] = "1"

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install genpool[triton])", allow_module_level=True)

import torch  # noqa: E402

if DEVICE.startswith("cuda") and not torch.cuda.is_available():
    pytest.skip(f"GENPOOL_TEST_DEVICE={DEVICE} but CUDA is not available", allow_module_level=True)

# A module imported earlier in the session without the interpreter flag holds compiled-mode
# kernels that cannot run on the CPU: re-run its @triton.jit decorators now that the flag is set.
for _name in ("genpool.kernels.triton.kv_write", "genpool.kernels.triton.paged_attention",
              "genpool.kernels.triton.rms_norm", "genpool.kernels.triton.rotary"):
    if DEVICE == "cpu" and _name in sys.modules:
        importlib.reload(sys.modules[_name])
