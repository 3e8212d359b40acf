"""How long one sequence may get: the model's context, and what the KV cache holds.

A sequence longer than the cache could be computed only in part: preempted, it could never be
placed again, and at the head of the waiting queue it would block every request behind it for
ever. So, as vLLM does, max_model_len never exceeds the cache: one the caller asked for is
refused at start, the model's own default is capped (and said so), and every request's prompt
+ max_tokens is held to it at submit (the scheduler keeps the same bound, engine/scheduler.py).
"""
from __future__ import annotations

import logging

from genpool.engine.sampling_params import SamplingParams

log = logging.getLogger("genpool.engine")
ROOM = "num_kv_blocks, kv_cache_memory or gpu_memory_utilization"  # the options that size the cache


def fit_to_cache(max_model_len: int, requested: int | None, num_blocks: int,
                 block_size: int) -> int:
    """max_model_len, capped to the cache's tokens; ValueError when the caller asked for more."""
    capacity = num_blocks * block_size
    if max_model_len <= capacity:
        return max_model_len
    if requested is not None:
        raise ValueError(f"max_model_len {max_model_len} does not fit in the KV cache: "
                         f"{num_blocks} blocks of {block_size} hold {capacity} tokens; ask for "
                         f"max_model_len <= {capacity}, or more cache ({ROOM})")
    log.warning("max_model_len capped to %d tokens, what the KV cache holds (%d blocks of %d); "
                "the model's %d needs more cache (%s)", capacity, num_blocks, block_size,
                max_model_len, ROOM)
    return capacity


def check_prompt(ids: list[int], vocab: int, max_model_len: int, capacity: int) -> None:
    if not ids:
        raise ValueError("prompt is empty")
    if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in ids):
        raise ValueError(f"prompt token ids must be ints in [0, {vocab})")
    if len(ids) >= max_model_len:
        limit = ("the KV cache holds only" if max_model_len >= capacity
                 else "the model's limit is")
        raise ValueError(f"prompt is {len(ids)} tokens; {limit} {max_model_len} including at "
                         f"least one generated token")


def cap_max_tokens(params: SamplingParams, prompt_len: int, max_model_len: int) -> SamplingParams:
    """prompt + max_tokens held to max_model_len (None: as many as fit), as the worker's admission
    assumes (workers/jobs.py's blocks_needed)."""
    room = max_model_len - prompt_len
    if params.max_tokens is None or params.max_tokens > room:
        params = params.clone(max_tokens=room, min_tokens=min(params.min_tokens, room))
    return params
