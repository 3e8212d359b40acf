"""`genpool worker`'s options are derived from EngineConfig / WorkerConfig, never copied by hand.

The defect this guards: the hand-copied option list never got `device`, so the compose GPU worker
ran its engine on the CPU. Every config field must have a flag, and each flag must reach its field.
"""
from __future__ import annotations

import dataclasses

import pytest

from genpool.engine.config import EngineConfig
from genpool.workers.cli.main import build_parser
from genpool.workers.cli.worker import engine_kwargs, worker_config
from genpool.workers.worker_config import WorkerConfig


def parse(*argv: str):
    return build_parser(load={"worker"}).parse_args(["worker", "--model", "m", *argv])


def worker_dests() -> set[str]:
    sub = build_parser(load={"worker"})._subparsers._group_actions[0].choices["worker"]
    return {a.dest for a in sub._actions}


@pytest.mark.parametrize("cls", [EngineConfig, WorkerConfig])
def test_every_config_field_has_a_worker_flag(cls):
    missing = [f.name for f in dataclasses.fields(cls)
               if f.metadata.get("cli", True) and f.name not in worker_dests()]  # cli False: bookkeeping
    assert not missing, f"{cls.__name__} fields without a `genpool worker` flag: {missing}"


def test_device_and_memory_options_reach_the_engine():
    a = parse("--device", "cuda:1", "--gpu-memory-utilization", "0.5", "--kv-cache-memory", "123456")
    kw = engine_kwargs(a)
    assert (kw["device"], kw["gpu_memory_utilization"], kw["kv_cache_memory"]) == ("cuda:1", 0.5, 123456)


def test_every_engine_flag_reaches_its_field():
    a = parse("--dtype", "bf16", "--device", "cpu", "--block-size", "32", "--max-num-seqs", "3",
              "--max-num-batched-tokens", "99", "--no-enable-prefix-caching", "--num-kv-blocks", "7",
              "--kv-cache-memory", "5", "--gpu-memory-utilization", "0.25", "--max-model-len", "77",
              "--kernel-backend", "torch", "--num-threads", "2", "--seed", "9",
              "--tensor-parallel-size", "3", "--grammar-compile-timeout-s", "4")
    cfg = EngineConfig(model=a.model, **engine_kwargs(a))
    assert cfg == EngineConfig(
        model="m", dtype="bf16", device="cpu", block_size=32, max_num_seqs=3, max_num_batched_tokens=99,
        enable_prefix_caching=False, num_kv_blocks=7, kv_cache_memory=5, gpu_memory_utilization=0.25,
        max_model_len=77, kernel_backend="torch", num_threads=2, seed=9, tensor_parallel_size=3,
        grammar_compile_timeout_s=4.0)
    q = parse("--quantization", "int8")
    assert EngineConfig(model=q.model, **engine_kwargs(q)).quantization == "int8"
    s = parse("--speculative-method", "ngram", "--num-speculative-tokens", "6",
              "--prompt-lookup-min", "1", "--prompt-lookup-max", "5", "--speculative-max-batch", "2")
    spec = EngineConfig(model=s.model, **engine_kwargs(s)).spec_config()
    assert (spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max,
            spec.max_batch) == (6, 1, 5, 2)
    assert not EngineConfig(model="m").spec_config().default_on  # only jobs that ask, unless a method


def test_defaults_are_the_dataclass_defaults():
    a = parse()
    assert EngineConfig(model="m", **engine_kwargs(a)) == EngineConfig(model="m")
    cfg = worker_config(a)
    # served_models and model_name are derived from --model when not given
    assert dataclasses.replace(cfg, name="n", served_models=frozenset(), model_name="") == \
        WorkerConfig(name="n")
    assert cfg.served_models == frozenset({"m"}) and cfg.model_name == "m" and cfg.name


def test_existing_spellings_still_work():
    a = parse("--no-prefix-caching", "--drain-timeout", "5", "--result-ttl", "60",
              "--served-model-name", "x", "--served-model-name", "y", "--name", "w1")
    assert engine_kwargs(a)["enable_prefix_caching"] is False
    cfg = worker_config(a)
    assert (cfg.drain_timeout_s, cfg.result_ttl_s, cfg.served_models, cfg.name) == \
        (5.0, 60, frozenset({"x", "y"}), "w1")


@pytest.mark.parametrize("bad", [["--device", "gpu"], ["--kernel-backend", "cuda"], ["--dtype", "int3"]])
def test_bad_values_are_refused(bad):
    try:
        kw = engine_kwargs(parse(*bad))
    except SystemExit:  # argparse refused it (choices)
        return
    with pytest.raises(ValueError):
        EngineConfig(model="m", **kw)


def test_auto_device_follows_torch(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert EngineConfig(model="m").resolved_device() == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert EngineConfig(model="m").resolved_device() == "cuda"
    assert EngineConfig(model="m", device="cuda:3").resolved_device() == "cuda:3"


def test_compose_gpu_worker_asks_for_the_gpu():
    from tests.pool_helpers import ROOT

    text = (ROOT / "compose.yaml").read_text()
    assert "driver: nvidia" in text and "--device cuda" in text
    cmd = text[text.index("exec genpool worker"):text.index("--metrics-port")].split()
    parse(*cmd[cmd.index("--dtype"):])  # every option in it is a real `genpool worker` flag


def test_engine_logs_its_choices_once(tiny_llama_path, caplog):
    import logging

    from genpool.engine import LLM
    from genpool.workers.cli.worker import log_engine_choice

    eng = LLM(str(tiny_llama_path), kernel_backend="torch", num_kv_blocks=8).llm_engine
    with caplog.at_level(logging.INFO, logger="genpool.worker"):
        log_engine_choice(eng)
    # the worker's one line (the engine's own warning, 8 blocks capping max_model_len, aside; and
    # records other threads of this process log meanwhile: only this thread's count)
    import threading
    (rec,) = [r for r in caplog.records if r.name == "genpool.worker" and r.thread == threading.get_ident()]
    assert "device=cpu dtype=float32 kernels=torch kv_blocks=8x16" in rec.getMessage()
    assert "settings: kernel_backend=torch (explicit), cpu_gemm=" in rec.getMessage()


def test_the_worker_and_the_fake_satisfy_the_engine_protocol(tiny_llama_path):
    from genpool.engine import LLM
    from genpool.engine.protocol import Engine, EngineStats
    from tests.fake_engine import FakeEngine

    for eng, blocks in ((FakeEngine(num_blocks=5), 5),
                        (LLM(str(tiny_llama_path), kernel_backend="torch", num_kv_blocks=8).llm_engine, 8)):
        assert isinstance(eng, Engine)
        st = eng.stats()
        assert isinstance(st, EngineStats) and st.kv_blocks_total == st["kv_blocks_total"] == blocks
        assert dict(st)["num_running"] == st.num_running == 0
