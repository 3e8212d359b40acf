"""Build our Llama-family model from an HF checkpoint directory (config.json + *.safetensors)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from genpool.engine.models import quant
from genpool.engine.models.llama import LlamaForCausalLM, ModelArgs
from genpool.kernels import KernelBackend, get_backend


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


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               kern: KernelBackend | None = None, quantization: str | None = None) -> LlamaForCausalLM:
    """The checkpoint's model on `device`, its linear weights packed for `kern` (bound to it;
    default: the torch reference backend).
    quantization: None (as stored), "int8" (per output channel, at load), "gguf" (the model's
    GGUF file, natively) or "awq" (an AWQ checkpoint); see engine/models/quant.py."""
    path = Path(path)
    kern = kern if kern is not None else get_backend("torch", torch.device(device).type)
    args, cfg = load_config(path)
    quantization = quant.checkpoint_quantization(cfg, quantization)
    if quantization == "gguf":
        from genpool.engine.models.gguf_loader import load_gguf_model
        return _packed(load_gguf_model(path, args, dtype, device, kern))
    if quantization == "awq":
        from genpool.engine.models.awq import load_awq_model
        return _packed(load_awq_model(path, args, dtype, device, kern))
    with torch.device("meta"):
        model = LlamaForCausalLM(args, kern)
    # copy=True: load_file's tensors live on a mapping of the file, which stayed resident (the
    # whole 513 MiB for SmolLM2) as long as any tensor (the embedding) still pointed into it
    state = {k: v.to(dtype, copy=True) for k, v in _read_state(path).items()}
    assign_state(model, state, args, path)
    if quantization == "int8":
        quant.quantize_model(model, "int8")
    return _packed(model.to(device).eval())


def assign_state(model: LlamaForCausalLM, state: dict, args: ModelArgs, path: Path) -> None:
    """Put a checkpoint's tensors into the (meta-device) model, refusing any mismatch. A tied
    lm_head becomes a transposed copy of the embedding (of a tensor-parallel rank's vocab slice):
    the embedding looks up rows, the head wants [hidden, vocab]."""
    tied = "lm_head.weight" not in state
    if tied and not args.tie_word_embeddings:
        raise ValueError(f"{path}: checkpoint has no lm_head.weight and does not tie embeddings")
    result = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in result.missing_keys if not (tied and k == "lm_head.weight_t")]
    if missing or result.unexpected_keys:
        raise ValueError(f"{path}: weights do not match the config: missing={missing[:8]} "
                         f"unexpected={result.unexpected_keys[:8]}")
    if tied:
        model.lm_head.weight_t = torch.nn.Parameter(model.model.embed_tokens.weight.t().contiguous())


def _packed(model: LlamaForCausalLM) -> LlamaForCausalLM:
    model.requires_grad_(False).pack_linears()
    return model
