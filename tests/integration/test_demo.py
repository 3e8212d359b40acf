"""`genpool demo` end to end (tiny model, the test Redis), and `genpool submit` / `status`."""
from __future__ import annotations

import subprocess
import sys

from tests.pool_helpers import ROOT, drop_prefix, new_prefix


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "genpool.workers.cli.main", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_demo_streams_a_summary(redis_url, tiny_llama_path):
    prefix = new_prefix("demo")
    try:
        done = run_cli("demo", "--model", str(tiny_llama_path), "--max-tokens", "8",
                       "--redis", redis_url, "--prefix", prefix)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "Summary of" in done.stderr and "8 tokens, first after" in done.stderr
        # the summary itself (random weights: any 8 tokens), whole sentences only: a sentence the
        # budget cut off is held back, and the demo says so
        assert done.stdout.strip() or "cut off at --max-tokens not shown" in done.stderr
    finally:
        drop_prefix(redis_url, prefix)


def test_submit_and_status_cli_without_workers(redis_url):
    prefix = new_prefix("cli")
    try:
        bad = run_cli("submit", "hi", "--max-tokens", "0", "--redis", redis_url,
                      "--prefix", prefix)
        assert bad.returncode == 2 and "max_tokens" in bad.stderr
        ok = run_cli("submit", "hi", "--no-wait", "--job-id", "cli-1", "--redis", redis_url,
                     "--prefix", prefix)
        assert ok.returncode == 0 and ok.stdout.strip() == "cli-1"
        st = run_cli("status", "--redis", redis_url, "--prefix", prefix)
        assert st.returncode == 0 and "normal        1        0" in st.stdout
        assert "workers: 0 alive" in st.stdout
    finally:
        drop_prefix(redis_url, prefix)
