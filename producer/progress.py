"""The progress bar of bulk commands (`genpool batch`): tqdm when installed, else plain notes."""
from __future__ import annotations

import sys


class _PlainProgress:
    """Stand-in when tqdm is missing or progress is off: notes still reach stderr."""

    def __init__(self, *_, **__): ...
    def set_postfix(self, **_): ...
    def update(self, _n): ...
    def close(self): ...

    @staticmethod
    def write(msg, file=sys.stderr):
        print(msg, file=file, flush=True)


def make_progress(total: int, initial: int, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:
        return _PlainProgress()
    return tqdm(total=total, initial=initial, unit="req", file=sys.stderr, dynamic_ncols=True,
                smoothing=0.1, disable=not enabled, desc="batch")
