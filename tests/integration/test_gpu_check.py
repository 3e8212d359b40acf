"""benchmarks/gpu_check.sh cannot rot: its --smoke mode runs every step on the CPU (tiny random
checkpoints it builds itself, Triton under the interpreter) and must print a table of passing rows."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from tests.pool_helpers import ROOT

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def test_gpu_check_smoke_runs_every_step(tmp_path):
    env = dict(os.environ, GPU_CHECK_OUT=str(tmp_path), GPU_CHECK_BUDGET_S="900", PYTHON=sys.executable,
               )
    out = subprocess.run(["bash", str(ROOT / "benchmarks/gpu_check.sh"), "--smoke"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    table = out.stdout[out.stdout.index("=== genpool GPU check"):]
    for check in ("parity triton=ref fp32", "throughput float32 triton", "attention tiny decode"):
        assert check in table, table
    assert "FAIL" not in table and table.count("PASS") == 3  # two parity rows, one attention row
    assert (tmp_path / "models" / "tiny-b" / "tokenizer.json").is_file()
