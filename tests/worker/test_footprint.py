"""Worker footprint pieces: start-phase logging, lazily resident KV, the default KV budget."""
from __future__ import annotations

import logging

import torch

from genpool.engine.cpu_alloc import KV_CAP, default_kv_budget, lazy_zeros, mem_available
from genpool.engine.startup import rss_bytes


def test_lazy_zeros_cost_nothing_until_written():
    before = rss_bytes()
    t = lazy_zeros((64, 1024, 1024), torch.float32)  # 256 MiB reserved
    assert rss_bytes() - before < 16 << 20
    assert t.shape == (64, 1024, 1024) and float(t[::7, ::97, ::89].abs().sum()) == 0.0
    t[:8].fill_(1.0)  # 32 MiB written: now resident
    assert rss_bytes() - before >= 30 << 20


def test_default_kv_budget_follows_need_machine_and_cap():
    assert default_kv_budget(10 << 20) == 10 << 20  # a small model's need is all it gets
    big = default_kv_budget(1 << 40)
    assert big <= KV_CAP and big <= max(1, mem_available() // 4)


def test_engine_logs_each_start_phase(tiny_llama_path, caplog):
    from genpool.engine import LLM

    with caplog.at_level(logging.INFO, logger="genpool.engine"):
        llm = LLM(str(tiny_llama_path), max_num_seqs=4, num_threads=1)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("start:")]
    for phase in ("model resolved", "tokenizer loaded", "weights loaded", "kernels built",
                  "KV allocated", "engine ready"):
        assert any(line.startswith(f"start: {phase} in ") and "RSS" in line for line in lines), \
            (phase, lines)
    kv = next(line for line in lines if line.startswith("start: KV allocated"))
    # the tiny model's need (4 seqs x 2048 tokens), far under the cap, sets the default budget
    assert "512 blocks of 16 tokens" in kv, kv
    assert llm.llm_engine.runner.num_blocks == 4 * 2048 // 16
