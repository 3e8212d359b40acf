"""A local .gguf file as a model, as llama.cpp and vLLM users pass one: `LLM("model.gguf")`.

The file carries everything: the architecture (GGUF metadata, read into an HF config by
transformers' GGUF support), the tokenizer and its chat template (tokenizer.ggml.* and
tokenizer.chat_template) and the weights, which load natively (engine/models/gguf_loader.py, no
fp32 copy). What the engine reads from a checkpoint directory (config.json, tokenizer files) is
written once into a small directory under $GENPOOL_HOME/models/gguf/, next to a link to the file;
the directory is named by the file's path, size and mtime, so a changed file is read anew.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from genpool.schemas.config import genpool_home

WEIGHTS = "model.gguf"  # the link to the user's file inside the model directory


def is_gguf_file(name_or_path) -> bool:
    p = Path(name_or_path).expanduser()
    return p.suffix.lower() == ".gguf" and p.is_file()


def _directory_for(path: Path) -> Path:
    st = path.stat()
    key = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return genpool_home() / "models" / "gguf" / f"{path.stem}-{key}"


def _check_file(path: Path) -> None:
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic at its start)")


def _write_metadata(path: Path, out: Path) -> None:
    """config.json + tokenizer files from the file's metadata (transformers' GGUF readers)."""
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    if getattr(cfg, "model_type", None) not in ("llama", "mistral", "qwen2"):
        raise ValueError(f"{path}: architecture {getattr(cfg, 'model_type', None)!r} is not served "
                         "here (llama, mistral, qwen2)")
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"{path}: the file carries no chat template (tokenizer.chat_template)")
    if hasattr(cfg, "quantization_config"):  # the weights load natively, not through transformers
        del cfg.quantization_config
    cfg.save_pretrained(out)
    tok.save_pretrained(out)
    gen = {k: getattr(cfg, k) for k in ("bos_token_id", "eos_token_id") if getattr(cfg, k, None) is not None}
    (out / "generation_config.json").write_text(json.dumps(gen))


def gguf_model_dir(path: str | os.PathLike) -> Path:
    """The model directory for a local .gguf file, written on first use (atomically: workers
    starting together see no half-written directory)."""
    path = Path(path).expanduser().resolve()
    _check_file(path)
    final = _directory_for(path)
    if (final / "config.json").is_file() and (final / WEIGHTS).exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        _write_metadata(path, tmp)
        (tmp / WEIGHTS).symlink_to(path)
        try:
            os.replace(tmp, final)
        except OSError:  # another process wrote it first: theirs is as good
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def is_gguf_model_dir(path: Path) -> bool:
    """A directory gguf_model_dir() wrote: its weights are the linked file, loaded natively."""
    return (Path(path) / WEIGHTS).is_symlink() and not list(Path(path).glob("*.safetensors"))
