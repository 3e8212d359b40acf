"""The kernels' process-wide settings, so that no kernel reads the environment itself.

The engine sets them once at start from its EngineConfig (engine/config.py
`apply_kernel_settings`), where an explicit config value beats the environment variable. Until
an engine has set them (kernels used on their own: tests, benchmarks), each read resolves the
settings table (schemas/settings.py): the variable, else the default.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Iterator, Optional

from genpool.schemas.settings import value

# field -> its row in schemas/settings.py
ENV = {"cpu_gemm": "GENPOOL_CPU_GEMM", "quant_compute": "GENPOOL_QUANT_COMPUTE",
       "huge_pages": "GENPOOL_HUGE_PAGES"}


@dataclass(frozen=True)
class KernelSettings:
    cpu_gemm: bool = True  # fp32 linear layers and prefill attention on our tile kernels
    quant_compute: str = "auto"  # kernels/cpu/qgemm.py compute_mode(): auto, amx, vnni, bf16, fp32
    huge_pages: bool = True  # packed weights in huge-page memory

    @classmethod
    def from_table(cls) -> "KernelSettings":
        return cls(**{f: value(env) for f, env in ENV.items()})


_current: Optional[KernelSettings] = None


def kernel_settings() -> KernelSettings:
    return _current if _current is not None else KernelSettings.from_table()


def set_kernel_settings(settings: Optional[KernelSettings]) -> None:
    """The engine's settings from now on (None: back to the table's)."""
    global _current
    _current = settings


@contextlib.contextmanager
def kernel_settings_as(**changes) -> Iterator[KernelSettings]:
    """These settings inside the block, the previous ones after (tests, benchmarks)."""
    before = _current
    s = dataclasses.replace(kernel_settings(), **changes)
    set_kernel_settings(s)
    try:
        yield s
    finally:
        set_kernel_settings(before)
