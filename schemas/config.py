"""Where Redis is and which key prefix to use: the same rules for every genpool component.

Order: an explicit URL (`--redis`) > `GENPOOL_REDIS_URL` > a Redis answering on 127.0.0.1:6379 >
the embedded server a genpool worker started earlier (recorded in a state file) > the default URL.
Stdlib only: producers must not need anything beyond redis + pydantic.
"""
from __future__ import annotations

import argparse
import json
import math
import socket
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

from .settings import value

DEFAULT_URL = "redis://127.0.0.1:6379/0"
DEFAULT_PREFIX = "genpool"
ENV_URL = "GENPOOL_REDIS_URL"
ENV_PREFIX = "GENPOOL_PREFIX"


def genpool_home() -> Path:
    """Where genpool keeps models, built kernels and the embedded Redis: $GENPOOL_HOME, default
    ~/.cache/genpool (the one definition; engine, kernels and workers all call this)."""
    return Path(value("GENPOOL_HOME")).expanduser()


def embedded_state_file() -> Path:
    """Written by workers/integrations/embedded.py when it starts a redis-server: {"url": ..., "pid": ...}."""
    return genpool_home() / "redis" / "embedded.json"


def answers(url: str, timeout: float = 0.3) -> bool:
    """True when something accepts a TCP (or unix socket) connection at `url`'s address."""
    u = urlparse(url)
    try:
        if u.scheme == "unix":
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(timeout)
                s.connect(u.path)
            return True
        with socket.create_connection((u.hostname or "127.0.0.1", u.port or 6379), timeout):
            return True
    except OSError:
        return False


def embedded_url() -> Optional[str]:
    """URL of a live embedded server started by an earlier genpool process, if any."""
    try:
        state = json.loads(embedded_state_file().read_text())
    except (OSError, ValueError):
        return None
    url = state.get("url") if isinstance(state, dict) else None
    return url if url and answers(url) else None


def redis_url(explicit: Optional[str] = None) -> str:
    got = value(ENV_URL, explicit or None)
    if got:
        return got
    if not answers(DEFAULT_URL):
        return embedded_url() or DEFAULT_URL
    return DEFAULT_URL


def key_prefix(explicit: Optional[str] = None) -> str:
    return value(ENV_PREFIX, explicit or None)


def add_connection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis", metavar="URL", default=None,
                   help="Redis URL: redis://host:port/db, redis+cluster://host:port[,host:port] "
                        "(Redis Cluster), or redis+sentinel://host:port[,host:port]/master_name"
                        f"[/db] (Sentinel); default: ${ENV_URL}, else redis://127.0.0.1:6379/0, else "
                        "the embedded server a worker started")
    p.add_argument("--prefix", default=None, help=f"key prefix (default: ${ENV_PREFIX} or genpool)")


class HELP_FMT(argparse.HelpFormatter):
    """Every option's help shows its default (unless the help already says it, or there is
    none to show: a flag that is off, an option that is unset)."""

    def _get_help_string(self, action):
        h = action.help or ""
        if "default" in h or any(action.default is v for v in (None, False, argparse.SUPPRESS)) or \
                action.option_strings == [] or action.nargs == 0:
            return h
        return h + " (default: %(default)s)"


# argparse types of number options: a NaN or infinite value, or a negative count or duration,
# means nothing an option could do (`--timeout nan` waited for ever): refused at parse time
def _number(kind, what: str, ok):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if kind is float and not math.isfinite(v) or not ok(v):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return v
    parse.number = True  # tests/worker/test_cli_numbers.py finds every number option by it
    parse.__name__ = what.replace(" ", "_")  # argparse names the type in its messages
    return parse


finite = _number(float, "a finite number", lambda v: True)
positive = _number(float, "a number > 0", lambda v: v > 0)
seconds = _number(float, "a number of seconds >= 0", lambda v: v >= 0)
positive_seconds = _number(float, "a number of seconds > 0", lambda v: v > 0)
count = _number(int, "a whole number >= 1", lambda v: v >= 1)
