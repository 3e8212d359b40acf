"""What every layer needs to know about one step's flat batch: built once per step by the runner."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SampledRows:
    """The last layer's attention metadata for the sampled rows alone (one query each)."""
    rows: torch.Tensor  # [R] flat row of each sampled sequence's last token
    block_tables: torch.Tensor  # [R, max_blocks]
    query_start_loc: torch.Tensor  # [R + 1] = 0..R
    seq_lens: torch.Tensor  # [R]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each token's K/V goes: block_id * block_size + offset
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0
    query_start_loc: torch.Tensor  # [S + 1] int32: sequence i's rows are qsl[i]:qsl[i+1]
    seq_lens: torch.Tensor  # [S] int32: tokens each sequence attends to (computed + new)
    rope: torch.Tensor  # [max_pos, head_dim] cos | sin
    # None: every row is sampled (one per sequence, in order); else the sampled rows' metadata
    # (no rows at all when a prompt chunk ends mid-prompt)
    keep: SampledRows | None = None
    decode_only: bool = False  # one new token per sequence, every one of them sampled
