"""Load one tensor-parallel rank's shard straight from safetensors (mmap'd; `get_slice` reads only
the rows or columns this rank keeps, so no rank ever holds the whole model)."""
from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from genpool.engine.models.loader import _packed, assign_state, load_config
from genpool.engine.models.tp_linear import TPShard, plan_shard, tp_model
from genpool.kernels import get_backend

# checkpoint name -> (which index range, which dimension): 0 = output rows, 1 = input columns
_SPLITS = [
    (re.compile(r"\.self_attn\.q_proj\.(weight|bias)$"), "q_heads", 0),
    (re.compile(r"\.self_attn\.[kv]_proj\.(weight|bias)$"), "kv_heads", 0),
    (re.compile(r"\.self_attn\.o_proj\.weight$"), "q_heads", 1),
    (re.compile(r"\.mlp\.(gate|up)_proj\.weight$"), "inter", 0),
    (re.compile(r"\.mlp\.down_proj\.weight$"), "inter", 1),
    (re.compile(r"^(model\.embed_tokens|lm_head)\.weight$"), "vocab", 0),
]


def _rows(shard: TPShard, kind: str, head_dim: int) -> slice:
    r = getattr(shard, kind)
    scale = head_dim if kind in ("q_heads", "kv_heads") else 1
    return slice(r.start * scale, r.stop * scale)


def _read(sl, name: str, shard: TPShard, head_dim: int) -> torch.Tensor:
    for pattern, kind, dim in _SPLITS:
        if pattern.search(name):
            s = _rows(shard, kind, head_dim)
            t = sl[s] if dim == 0 else sl[:, s]
            if kind == "vocab" and t.shape[0] < shard.vocab_per_rank:  # the last rank's short slice
                t = torch.cat([t, t.new_zeros(shard.vocab_per_rank - t.shape[0], *t.shape[1:])])
            return t
    return sl[:]  # replicated: norms


def read_shard(path: Path, shard: TPShard, head_dim: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors weights in {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                if "rotary_emb" not in name:  # rotary tables: we compute our own
                    state[name] = _read(st.get_slice(name), name, shard, head_dim).to(dtype)
    return state


def load_shard(path: str | Path, rank: int, size: int, comm, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", kern=None):
    """Rank `rank` of `size`'s model: its weights only, every collective through `comm`."""
    path = Path(path)
    args, _ = load_config(path)
    shard = plan_shard(args, rank, size)
    model = tp_model(args, shard, comm, kern if kern is not None else get_backend("torch", "cpu"))
    state = read_shard(path, shard, args.head_dim, dtype)
    assign_state(model, state, args, path)
    return _packed(model.to(device).eval())
