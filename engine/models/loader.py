"""Build our Llama-family model from an HF checkpoint directory (config.json + *.safetensors)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.models.llama import LlamaForCausalLM, ModelArgs


def load_config(path: str | Path) -> tuple[ModelArgs, dict]:
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{path} is not a model directory: no config.json")
    cfg = json.loads(cfg_file.read_text())
    return ModelArgs.from_hf(cfg), cfg


def _read_state(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors weights in {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    # Buffers some exporters include; we compute rotary tables ourselves.
    return {k: v for k, v in state.items() if "rotary_emb" not in k}


def load_model(path: str | Path, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> LlamaForCausalLM:
    path = Path(path)
    args, _ = load_config(path)
    with torch.device("meta"):
        model = LlamaForCausalLM(args)
    state = {k: v.to(dtype) for k, v in _read_state(path).items()}
    tied = "lm_head.weight" not in state
    if tied and not args.tie_word_embeddings:
        raise ValueError(f"{path}: checkpoint has no lm_head.weight and does not tie embeddings")
    result = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in result.missing_keys if not (tied and k == "lm_head.weight_t")]
    if missing or result.unexpected_keys:
        raise ValueError(f"{path}: weights do not match the config: missing={missing[:8]} "
                         f"unexpected={result.unexpected_keys[:8]}")
    if tied:  # a transposed copy: the embedding looks up rows, the lm_head wants [hidden, vocab]
        model.lm_head.weight_t = torch.nn.Parameter(model.model.embed_tokens.weight.t().contiguous())
    return model.to(device).eval().requires_grad_(False)
