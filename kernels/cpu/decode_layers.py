"""Launcher for kernels/cpu/cpu_decode_layers.c: a pure-decode step's whole decoder stack in one call.

`build(...)` takes the model's tensors once and returns a `DecodeLayers`, or None when a layer is
not what the C stack runs (a weight not packed for kernels/cpu/cpu_gemm.c, a gate_up that cannot take
the SwiGLU epilogue, caches neither fp32 nor bf16, or non-contiguous): the model then keeps its module path.
Reference: the same model run layer by layer through the CPU backend's kernels, which gives the
same bits (tests/kernels/test_kernels_cpu_decode_layers.py).
"""
from __future__ import annotations

import ctypes
from functools import cache

import torch

from genpool.kernels import kvq
from genpool.kernels.cpu import build as cpu_build
from genpool.kernels.cpu import gemm as cpu_gemm
from genpool.kernels.cpu import qgemm as cpu_qgemm

WEIGHTS = ("qkv", "o", "gate_up", "down")

_ERRORS = {-1: "out of memory", -2: "the all-reduce between layers failed", -101: "GEMM out of memory",
           -104: "SwiGLU columns are not whole panels",
           -201: "a position lies outside the rotary table", -302: "a slot lies outside the KV cache",
           -401: "decode attention out of memory", -402: "a block id lies outside the KV cache",
           -403: "a sequence length lies outside its block table"}


class _Dims(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("layers", "hidden", "inter", "nh", "nkv", "hd", "block_size",
                                              "num_blocks", "max_pos", "kv_dtype")] + [("eps", ctypes.c_float),
                                                                                        ("scale", ctypes.c_float)]


class _Layer(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in ("ln1", "ln2", "qkv", "qkv_bias", "o", "gate_up", "down", "k_cache",
                                               "v_cache", "qqkv", "qo", "qgate_up", "qdown")]


@cache
def _kernel():
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return cpu_build.function("cpu_decode_layers", "decode_layers",
                              [ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, ctypes.c_int, _REDUCE],
                              ctypes.c_int)


# int reduce(float *x, int64_t n): tensor parallelism's all-reduce between layers (see the C file)
_REDUCE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.c_int64)


def _reduce_callback(all_reduce):
    """A C-callable wrapper of all_reduce(tensor) (in place) for the stack, or NULL without one."""
    if all_reduce is None:
        return _REDUCE()

    def call(ptr, n):
        try:
            all_reduce(torch.frombuffer((ctypes.c_float * n).from_address(ctypes.addressof(ptr.contents)),
                                        dtype=torch.float32))
            return 0
        except Exception:  # an exception cannot cross the C frames: report it as the step's error
            return 1
    return _REDUCE(call)


def available() -> bool:
    return _kernel() is not None


def _fp32(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous())


KV_DTYPES = cpu_build.KV_DTYPE_CODES  # the caches the stack takes: fp32, bf16 or int8 (dims_t.kv_dtype)


def _cache_ok(t: torch.Tensor, like: torch.Tensor) -> bool:
    """A contiguous CPU cache of the first layer's K cache's shape and dtype (fp32, bf16 or int8)."""
    return (t.dtype == like.dtype and t.dtype in KV_DTYPES and t.device.type == "cpu" and t.is_contiguous()
            and t.shape == like.shape)


def _layer_ok(lay: dict, hidden: int, qkv_n: int, cache: torch.Tensor) -> bool:
    packed = [lay[n] for n in WEIGHTS]  # fp32 panels (cpu_gemm.c) or quantized ones (cpu_qgemm.c)
    return (all(isinstance(w, (cpu_gemm.PackedWeight, cpu_qgemm.QPackedWeight)) for w in packed)
            and lay["gate_up"].swiglu_fusable
            and all(w.bias is None for w in packed[1:]) and lay["qkv"].n == qkv_n and lay["o"].n == hidden
            and lay["qkv"].k == hidden and lay["gate_up"].k == hidden and lay["down"].n == hidden
            and all(_fp32(lay[n]) and lay[n].shape == (hidden,) for n in ("ln1", "ln2"))
            and all(_cache_ok(lay[n], cache) for n in ("k_cache", "v_cache")))


def _panels(w) -> int | None:
    return w.panels.data_ptr() if isinstance(w, cpu_gemm.PackedWeight) else None


def _quantized(w) -> int | None:
    """The address of a quantized weight's qweight_t (alive as long as the weight), or NULL."""
    return ctypes.addressof(w.struct) if isinstance(w, cpu_qgemm.QPackedWeight) else None


class DecodeLayers:
    """The decoder stack of one model over one set of KV caches (their pointers are fixed here)."""

    def __init__(self, layers: list[dict], final_norm: torch.Tensor, dims: _Dims, all_reduce=None):
        self._keep = (layers, final_norm)  # the C side holds raw pointers into these
        self._reduce = _reduce_callback(all_reduce)  # kept alive as long as the C side may call it
        self.dims = dims
        self.layers = (_Layer * len(layers))(*[_Layer(
            lay["ln1"].data_ptr(), lay["ln2"].data_ptr(), _panels(lay["qkv"]),
            None if lay["qkv"].bias is None else lay["qkv"].bias.data_ptr(), _panels(lay["o"]),
            _panels(lay["gate_up"]), _panels(lay["down"]), lay["k_cache"].data_ptr(),
            lay["v_cache"].data_ptr(), *[_quantized(lay[n]) for n in WEIGHTS]) for lay in layers])
        self.final_norm = final_norm

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, rope: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """x [B, H] fp32 embeddings of B decode rows (one token each) -> final-normed hidden [B, H]."""
        d = self.dims
        if x.dim() != 2 or x.shape[1] != d.hidden or not _fp32(x):
            raise ValueError(f"x must be a contiguous CPU float32 [B, {d.hidden}] tensor, "
                             f"got {tuple(x.shape)} {x.dtype}")
        m = x.shape[0]
        if rope.shape != (d.max_pos, d.hd) or not _fp32(rope):
            raise ValueError(f"rope table {tuple(rope.shape)} {rope.dtype}: expected fp32 [{d.max_pos}, {d.hd}]")
        pos, slots = positions.to(torch.int64).contiguous(), slot_mapping.to(torch.int64).contiguous()
        tables, lens = block_tables.to(torch.int32).contiguous(), seq_lens.to(torch.int32).contiguous()
        if pos.shape != (m,) or slots.shape != (m,) or lens.shape != (m,) or tables.dim() != 2 or tables.shape[0] != m:
            raise ValueError(f"metadata for {m} rows: positions {tuple(pos.shape)}, slots {tuple(slots.shape)}, "
                             f"seq_lens {tuple(lens.shape)}, block_tables {tuple(tables.shape)}")
        out = torch.empty_like(x)
        if m == 0:
            return out
        rc = _kernel()(ctypes.byref(d), self.layers, self.final_norm.data_ptr(), x.data_ptr(), out.data_ptr(), m,
                       pos.data_ptr(), rope.data_ptr(), slots.data_ptr(), tables.data_ptr(), tables.shape[1],
                       lens.data_ptr(), torch.get_num_threads(), self._reduce)
        if rc != 0:
            raise RuntimeError(f"CPU decode layers failed: {_ERRORS.get(rc, rc)}")
        return out


def build(layers: list[dict], final_norm: torch.Tensor, *, num_heads: int, num_kv_heads: int, head_dim: int,
          eps: float, scale: float, max_pos: int, all_reduce=None) -> DecodeLayers | None:
    """layers: per layer a dict of ln1, ln2 (norm weights), qkv, o, gate_up, down (cpu_gemm.PackedWeight
    or cpu_qgemm.QPackedWeight), k_cache, v_cache ([blocks, bs, kv heads, head_dim]). all_reduce(x):
    under tensor parallelism, sums x over the ranks in place after each o_proj and down product.
    None when the C stack cannot run them."""
    if not layers or _kernel() is None or not _fp32(final_norm) or num_heads % num_kv_heads or head_dim % 2:
        return None  # (GQA groups and rotary halves: the module path's kernels refuse these with an error)
    hidden = final_norm.shape[0]
    cache = layers[0]["k_cache"]
    cache_shape = cache.shape
    qkv_n = (num_heads + 2 * num_kv_heads) * head_dim
    if (len(cache_shape) != 4 or tuple(cache_shape[2:]) != (num_kv_heads, kvq.row_dim(head_dim, cache.dtype))
            or not all(_layer_ok(lay, hidden, qkv_n, cache) for lay in layers)):
        return None
    inter = layers[0]["gate_up"].n // 2
    if any(lay["gate_up"].n != 2 * inter or lay["down"].k != inter or lay["o"].k != num_heads * head_dim
           for lay in layers):
        return None
    dims = _Dims(len(layers), hidden, inter, num_heads, num_kv_heads, head_dim, cache_shape[1], cache_shape[0],
                 max_pos, KV_DTYPES[cache.dtype], eps, scale)
    return DecodeLayers(layers, final_norm, dims, all_reduce)
