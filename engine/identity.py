"""Which model an engine runs, as a resume needs to know it: `ModelIdentity`.

A job resumed on another worker continues exactly only if that worker computes the same logits and
reads token ids the same way. So the identity is what decides both: the checkpoint's revision
(a fingerprint of its files), the dtype, the quantization, the tokenizer, and the KV cache's dtype
where it is not the model's (bf16 K/V under an fp32 model change the logits), and for quantized
weights on the CPU how their products compute (kernels/cpu/qgemm.py compute_mode(): int8 dot
products quantize activations, AMX tiles round them to bf16, the widening kernel keeps them fp32;
a fleet of mixed CPUs picks different ones under "auto"). The worker records
`identity.key` (or `to_dict()`) with a job's first token; a taker whose identity `mismatch()`es
restarts the job instead, and `mismatch()` says why.

The name the engine was started with (`model`) is carried for the record but not compared: one
checkpoint may sit at different paths on different machines, and which name a job is served under
is the pool's business. The device and kernel backend are not compared either: they change fp32
sums only in the last bits (near-ties apart, as the parity tests allow), as batching does.

The revision fingerprint reads, of every weight file, its name, its size and 16 slices of 64 KiB
spread over it (first and last included), plus config.json: ~1 MiB a file, so it costs
milliseconds even for a large model, and two fine-tunes of one architecture (same headers, same
sizes) still differ in their sampled bytes.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from genpool.engine.config import DTYPES, EngineConfig

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
_SLICES, _SLICE_BYTES = 16, 64 << 10
_COMPARED = ("revision", "dtype", "quantization", "tokenizer")
_OPTIONAL = ("kv_cache_dtype", "products")  # compared too; None (the usual case) stays out of the key


@dataclass(frozen=True)
class ModelIdentity:
    model: str  # as configured (a registry name or a path): informative, not compared
    revision: str  # fingerprint of config.json and the weight files (hex)
    dtype: str  # canonical torch name: "float32", "bfloat16", "float16"
    quantization: str | None  # None, "int8", "gguf", "awq" (an AWQ checkpoint counts unasked)
    tokenizer: str  # hash of the tokenizer's full definition and chat template (hex)
    kv_cache_dtype: str | None = None  # None: the model's dtype; else the cache's ("bfloat16")
    products: str | None = None  # quantized on the CPU: "amx", "vnni", "bf16" or "fp32"; else None

    @property
    def key(self) -> str:
        """One short string for the compared fields: equal keys, same logits and token ids."""
        fields = [getattr(self, f) for f in _COMPARED]
        if self.kv_cache_dtype is not None:  # absent from the keys of engines with the model's KV dtype
            fields.append(self.kv_cache_dtype)
        if self.products is not None:  # absent from the keys of unquantized engines
            fields.append(["products", self.products])
        blob = json.dumps(fields).encode()
        return hashlib.sha256(blob).hexdigest()[:32]

    def mismatch(self, other: "ModelIdentity") -> str | None:
        """Why a job started on `self` cannot continue exactly on `other` (None: it can)."""
        diffs = [f"{f} {getattr(self, f)!r} != {getattr(other, f)!r}" for f in (*_COMPARED, *_OPTIONAL)
                 if getattr(self, f) != getattr(other, f)]
        return "model identity differs: " + ", ".join(diffs) if diffs else None

    def to_dict(self) -> dict:
        return dict(asdict(self), key=self.key)

    @classmethod
    def from_dict(cls, data: dict) -> "ModelIdentity":
        return cls(**{f: data[f] for f in ("model", *_COMPARED)}, **{f: data.get(f) for f in _OPTIONAL})


def _file_fingerprint(h, path: Path) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}\0{size}\0".encode())
    with open(path, "rb") as f:
        step = max(1, (size - _SLICE_BYTES) // (_SLICES - 1)) if size > _SLICE_BYTES else size
        for i in range(_SLICES):
            offset = min(i * step, max(0, size - _SLICE_BYTES))
            f.seek(offset)
            h.update(f.read(_SLICE_BYTES))
            if size <= _SLICE_BYTES:
                break


def revision_fingerprint(model_path: Path) -> str:
    """config.json plus the sampled bytes of every weight file in the checkpoint directory."""
    model_path = Path(model_path)
    h = hashlib.sha256()
    cfg = model_path / "config.json"
    if cfg.is_file():
        h.update(cfg.read_bytes())
    for f in sorted(model_path.iterdir()):
        if f.suffix in _WEIGHT_SUFFIXES and f.is_file():  # a symlink to a .gguf counts too
            _file_fingerprint(h, f.resolve())
    return h.hexdigest()[:32]


def tokenizer_fingerprint(tokenizer) -> str:
    """The fast tokenizer's whole serialisation (vocabulary, merges, normaliser, special tokens)
    when it has one, else its vocabulary; plus the chat template (it makes the prompt's ids)."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(str(getattr(tokenizer, "chat_template", None)).encode())
    return h.hexdigest()[:32]


def model_identity(config: EngineConfig, model_path: Path, tokenizer) -> ModelIdentity:
    from genpool.engine.models.quant import checkpoint_quantization

    cfg = json.loads((Path(model_path) / "config.json").read_text())
    quantization = checkpoint_quantization(cfg, config.quantization)
    return ModelIdentity(
        model=str(config.model), revision=revision_fingerprint(model_path),
        dtype=DTYPES[config.dtype], quantization=quantization,
        tokenizer=tokenizer_fingerprint(tokenizer),
        kv_cache_dtype=None if config.kv_dtype_name == DTYPES[config.dtype] else config.kv_dtype_name,
        products=_cpu_products(config) if quantization else None)


def _cpu_products(config: EngineConfig) -> str | None:
    """How quantized products compute on this CPU (the engine applied its kernel settings at start)."""
    if config.resolved_device() != "cpu":
        return None
    from genpool.kernels.cpu import qgemm as cpu_qgemm
    return cpu_qgemm.compute_mode()
