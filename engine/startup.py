"""Start-phase log lines: what each phase of an engine start did, how long it took, and the
process's resident memory after it, so a slow start (a minute under load) is never silent and a
large footprint can be traced to its phase."""
from __future__ import annotations

import logging
import os
import time

log = logging.getLogger("genpool.engine")


def rss_bytes() -> int:
    """Resident set size of this process (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"


class StartLog:
    """One INFO line per phase: `start: <phase> in <s> s (<details>); RSS <MiB>`."""

    def __init__(self) -> None:
        self.t0 = self.last = time.perf_counter()

    def phase(self, name: str, details: str = "") -> None:
        now = time.perf_counter()
        rss = rss_bytes()
        log.info("start: %s in %.1f s%s; RSS %s", name, now - self.last,
                 f" ({details})" if details else "", mib(rss))
        self.last = now

    def done(self) -> None:
        log.info("start: engine ready in %.1f s; RSS %s", time.perf_counter() - self.t0,
                 mib(rss_bytes()))
