"""Tokenizer loading (HF fast tokenizer files; HF modelling code is not used)."""
from __future__ import annotations

import json
from pathlib import Path


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def read_eos_ids(path: Path, args, tokenizer) -> list[int]:
    """Every id that ends generation: config, generation_config.json and the tokenizer's eos."""
    ids: list[int] = list(args.eos_token_id or [])
    gen = Path(path) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids += [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    out = list(dict.fromkeys(ids))
    if not out:
        raise ValueError(f"{path}: no eos token id in config, generation_config or tokenizer")
    return out
