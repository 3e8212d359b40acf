"""One settings table (schemas/settings.py): an explicit config value beats the environment
variable, which beats the default; the report names each value's source; the kernels take the
engine's values; and no product module reads a GENPOOL_ variable anywhere else (checked on the
source, as tests/test_layering.py checks imports)."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from genpool.engine.config import EngineConfig, apply_kernel_settings
from genpool.schemas import settings
from genpool.schemas.config import genpool_home, key_prefix

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("engine", "kernels", "workers", "producer", "schemas")
TABLE = Path("schemas/settings.py")


@pytest.fixture
def clean_env(monkeypatch):
    """No GENPOOL_ variable set, and no engine's kernel settings left from an earlier test (an
    engine sets them process-wide)."""
    from genpool.kernels.settings import set_kernel_settings

    for s in settings.SETTINGS:
        monkeypatch.delenv(s.env, raising=False)
    set_kernel_settings(None)
    yield monkeypatch
    set_kernel_settings(None)


def test_explicit_beats_env_beats_default(clean_env):
    assert EngineConfig(model="m").cpu_gemm is True  # the row's default
    clean_env.setenv("GENPOOL_CPU_GEMM", "0")
    clean_env.setenv("GENPOOL_KERNEL_BACKEND", "torch")
    cfg = EngineConfig(model="m")
    assert (cfg.cpu_gemm, cfg.kernel_backend) == (False, "torch")
    cfg = EngineConfig(model="m", cpu_gemm=True, kernel_backend="auto")
    assert (cfg.cpu_gemm, cfg.kernel_backend) == (True, "auto")  # "auto" given is "auto" run
    clean_env.setenv("GENPOOL_PREFIX", "from-env")
    assert (key_prefix(), key_prefix("given")) == ("from-env", "given")
    clean_env.setenv("GENPOOL_HOME", "/tmp/gp-home")
    assert genpool_home() == Path("/tmp/gp-home")


def test_the_report_names_each_source(clean_env):
    clean_env.setenv("GENPOOL_HUGE_PAGES", "off")
    cfg = EngineConfig(model="m", quant_compute="fp32")
    assert cfg.setting_sources == {"kernel_backend": "default", "cpu_gemm": "default",
                                   "quant_compute": "explicit",
                                   "huge_pages": "env GENPOOL_HUGE_PAGES", "malloc_tune": "default"}
    line = cfg.settings_report()
    assert "quant_compute=fp32 (explicit)" in line and "huge_pages=False (env GENPOOL_HUGE_PAGES)" in line
    assert "kernel_backend=auto (default)" in line
    # the engine's own copies (dataclasses.replace, asdict to a tensor-parallel rank) keep them
    moved = dataclasses.replace(cfg, device="cpu")
    assert moved.setting_sources == cfg.setting_sources
    assert EngineConfig(**dataclasses.asdict(moved)).setting_sources == cfg.setting_sources
    assert dataclasses.replace(cfg, huge_pages=True).setting_sources["huge_pages"] == "explicit"


def test_a_bad_value_is_an_error_naming_the_variable(clean_env):
    clean_env.setenv("GENPOOL_QUANT_COMPUTE", "int3")
    with pytest.raises(ValueError, match="GENPOOL_QUANT_COMPUTE='int3'"):
        EngineConfig(model="m")
    clean_env.setenv("GENPOOL_CPU_GEMM", "maybe")
    with pytest.raises(ValueError, match="GENPOOL_CPU_GEMM"):
        settings.value("GENPOOL_CPU_GEMM")
    clean_env.setenv("GENPOOL_CPU_GEMM", "  ")
    assert settings.resolve("GENPOOL_CPU_GEMM").source == "default"  # blank is unset
    with pytest.raises(KeyError):
        settings.env_text("GENPOOL_NOT_IN_THE_TABLE")


def test_the_kernels_take_the_engines_values_over_the_environment(clean_env):
    from genpool.kernels.cpu import memory as cpu_memory
    from genpool.kernels.cpu import qgemm as cpu_qgemm
    from genpool.kernels.settings import kernel_settings, set_kernel_settings

    clean_env.setenv("GENPOOL_QUANT_COMPUTE", "fp32")
    assert kernel_settings().quant_compute == "fp32"  # no engine yet: the table's value
    try:
        apply_kernel_settings(EngineConfig(model="m", quant_compute="auto", huge_pages=False))
        assert kernel_settings().quant_compute == "auto" and not cpu_memory.huge_pages_available()
        assert cpu_qgemm.compute_mode() in ("amx", "vnni", "bf16", "fp32")
        apply_kernel_settings(EngineConfig(model="m"))  # not given: the environment's
        assert cpu_qgemm.compute_mode() == "fp32"
    finally:
        set_kernel_settings(None)


def test_an_engine_hands_its_explicit_values_to_the_kernels(clean_env, tiny_llama_path):
    """The environment says one thing, the engine's config another: the config runs."""
    from genpool.engine.llm import LLM
    from genpool.kernels.cpu import qgemm as cpu_qgemm
    from genpool.kernels.settings import kernel_settings, set_kernel_settings

    clean_env.setenv("GENPOOL_QUANT_COMPUTE", "fp32")
    clean_env.setenv("GENPOOL_CPU_GEMM", "1")
    try:
        with LLM(str(tiny_llama_path), num_threads=1, quant_compute="bf16", cpu_gemm=False):
            assert (kernel_settings().quant_compute, kernel_settings().cpu_gemm) == ("bf16", False)
            assert cpu_qgemm.compute_mode() in ("bf16", "fp32")  # bf16, or fp32 without AVX512-BF16
        with LLM(str(tiny_llama_path), num_threads=1):  # nothing given: the environment's
            assert (kernel_settings().quant_compute, kernel_settings().cpu_gemm) == ("fp32", True)
    finally:
        set_kernel_settings(None)


def test_cli_options_come_from_the_fields_and_name_the_variable():
    import argparse

    from genpool.engine.config_args import add_dataclass_args, dataclass_kwargs

    p = argparse.ArgumentParser()
    add_dataclass_args(p, EngineConfig)
    text = p.format_help()
    assert "--no-cpu-gemm" in text and "$GENPOOL_CPU_GEMM" in text and "--setting-sources" not in text
    kw = dataclass_kwargs(p.parse_args(["--model", "m", "--no-huge-pages"]), EngineConfig)
    cfg = EngineConfig(**kw)
    assert cfg.huge_pages is False and cfg.setting_sources["huge_pages"] == "explicit"


def test_every_row_is_unique_and_parses_its_default_kind():
    envs = [s.env for s in settings.SETTINGS]
    assert len(envs) == len(set(envs)) and all(e.startswith("GENPOOL_") for e in envs)
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert {s.field for s in settings.rows_of("EngineConfig")} <= fields


def _constants(tree: ast.Module) -> dict[str, str]:
    return {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
            and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
            for t in n.targets if isinstance(t, ast.Name)}


def _imported_constants() -> dict[str, str]:
    """Every product module's module-level GENPOOL_ constants (ENV_URL = "GENPOOL_REDIS_URL"),
    so a read through an imported name is found too."""
    out = {}
    for rel in _product_files():
        out.update({k: v for k, v in _constants(ast.parse((ROOT / rel).read_text())).items()
                    if v.startswith("GENPOOL_")})
    return out


def _knob_reads(path: Path, imported: dict | None = None) -> list[str]:
    """`os.environ.get("GENPOOL_X")`, `os.environ["GENPOOL_X"]`, `os.getenv(...)`, `... in
    os.environ`, with the name written out or held in a (module-level or imported) constant."""
    tree = ast.parse(path.read_text())
    consts = {**(_imported_constants() if imported is None else imported), **_constants(tree)}

    def knob(node) -> str:
        v = node.value if isinstance(node, ast.Constant) else consts.get(getattr(node, "id", ""))
        return v if isinstance(v, str) and v.startswith("GENPOOL_") else ""

    def is_environ(node) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "environ") or \
            (isinstance(node, ast.Name) and node.id == "environ")

    found = []
    for n in ast.walk(tree):
        key = None
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.args:
            if (is_environ(n.func.value) and n.func.attr in ("get", "setdefault", "pop")) or \
                    n.func.attr == "getenv":
                key = n.args[0]
        elif isinstance(n, ast.Subscript) and is_environ(n.value):
            key = n.slice
        elif isinstance(n, ast.Compare) and any(is_environ(c) for c in n.comparators):
            key = n.left
        if key is not None and knob(key):
            found.append(f"{path}:{n.lineno} reads {knob(key)}")
    return found


def _product_files():
    for top in PRODUCT:
        for p in sorted((ROOT / top).rglob("*.py")):
            yield p.relative_to(ROOT)


def test_no_genpool_knob_is_read_outside_the_table():
    imported = _imported_constants()
    reads = [r for rel in _product_files() if rel != TABLE
             for r in _knob_reads(ROOT / rel, imported)]
    assert not reads, "read these through genpool.schemas.settings:\n" + "\n".join(reads)
    assert _knob_reads(ROOT / TABLE) == []  # the table reads by a variable's name, from its rows


def test_the_checker_finds_a_read(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('import os\nX = "GENPOOL_X"\na = os.environ.get("GENPOOL_Y")\nb = os.environ[X]\n'
                   'c = os.getenv("GENPOOL_Z", "1")\nd = "GENPOOL_W" in os.environ\ne = os.environ.get("HOME")\n')
    assert [r.split(" reads ")[1] for r in _knob_reads(bad, {})] == ["GENPOOL_Y", "GENPOOL_X", "GENPOOL_Z",
                                                                 "GENPOOL_W"]


def _spin_env_after_start(env: dict, code: str) -> str:
    """GOMP_SPINCOUNT as a fresh interpreter sees it after `code` has run (and torch has loaded)."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")} | env
    out = subprocess.run([sys.executable, "-P", "-c", code + "\nimport os, torch\n"
                          "print(os.environ.get('GOMP_SPINCOUNT', '-'))"],
                         env=env, capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("entry", ["from genpool.workers.cli.main import main; main([])",
                                   "import genpool.workers.integrations.celery_app",
                                   "from genpool.engine import LLM"])
def test_the_worker_entry_points_bound_openmp_spinning_before_torch_loads(entry):
    """The genpool command, the Celery app and the engine's package set libgomp's spin (read once,
    when torch loads it) to the bounded value unless the environment names a policy itself; set
    after torch, nothing."""
    assert _spin_env_after_start({}, entry) == settings.OPENMP_SPINCOUNT
    assert _spin_env_after_start({"GOMP_SPINCOUNT": "7"}, entry) == "7"
    assert _spin_env_after_start({"OMP_WAIT_POLICY": "PASSIVE"}, entry) == "-"
    assert _spin_env_after_start({}, "import torch\nfrom genpool.schemas.settings import bound_openmp_spinning\n"
                                     "assert not bound_openmp_spinning()") == "-"


@pytest.mark.parametrize("env, warned", [({}, True), ({"GOMP_SPINCOUNT": "1000"}, False),
                                         ({"OMP_WAIT_POLICY": "PASSIVE"}, False)])
def test_a_cpu_engine_warns_when_torchs_openmp_spins_unbounded(tiny_llama_path, monkeypatch, caplog, env, warned):
    """torch loaded with no wait policy (libgomp's ~300,000 spins after each op, which take cores
    from the kernels' pool): a CPU engine says so at start, with the fix; with a policy set, nothing."""
    import logging

    from genpool.engine.config import EngineConfig
    from genpool.engine.model_runner import ModelRunner
    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(name, raising=False)
    for name, val in env.items():
        monkeypatch.setenv(name, val)
    with caplog.at_level(logging.WARNING, logger="genpool.engine.model_runner"):
        ModelRunner(EngineConfig(model=str(tiny_llama_path), num_kv_blocks=8), tiny_llama_path, 64)
    hits = [r.getMessage() for r in caplog.records if "GOMP_SPINCOUNT" in r.getMessage()]
    assert bool(hits) == warned, hits
    assert all("~10% slower" in h for h in hits), hits  # the message as a reader sees it
