"""`genpool worker`: one resident engine serving one prefix's lane streams."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
from pathlib import Path

from genpool.engine.config_args import add_dataclass_args, dataclass_kwargs
from genpool.schemas.config import HELP_FMT, add_connection_args
from genpool.schemas.settings import value
from genpool.workers.worker_runner import add_runner_args, run_worker

log = logging.getLogger("genpool.worker")


def register_worker(sub) -> None:
    from genpool.engine.config import EngineConfig
    from genpool.workers.worker_config import WorkerConfig

    p = sub.add_parser("worker", help="run a resident worker: Redis lane streams -> engine",
                       description="Run one resident engine serving this prefix's lane streams "
                       "until SIGTERM/Ctrl-C (then it drains in-flight jobs). Starts an embedded "
                       "Redis when none answers; pulls and converts a registry model on first use.",
                       formatter_class=HELP_FMT)
    add_connection_args(p)
    # every engine and queue option comes from the config dataclasses' fields (engine/config_args.py)
    add_dataclass_args(p.add_argument_group("engine"), EngineConfig)
    g = p.add_argument_group("queue")
    add_dataclass_args(g, WorkerConfig)
    g.add_argument("--engine-factory", default=None, help=argparse.SUPPRESS)  # tests: module:fn
    g.add_argument("--log-level", default=value("GENPOOL_LOG_LEVEL"),
                   type=str.upper, choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
                   metavar="LEVEL", help="Python logging level: DEBUG, INFO, WARNING, ERROR or "
                   "CRITICAL (default: %(default)s; $GENPOOL_LOG_LEVEL sets it, else INFO)")
    add_runner_args(p)  # --metrics-port, --celery-events, --celery (workers/worker_runner.py)
    p.set_defaults(func=cmd_worker)


def engine_kwargs(a: argparse.Namespace) -> dict:
    """EngineConfig's fields from the parsed options, except `model` (build_engine's first argument)."""
    from genpool.engine.config import EngineConfig

    return dataclass_kwargs(a, EngineConfig, skip=("model",))


def worker_config(a: argparse.Namespace):
    from genpool.workers.worker_config import WorkerConfig

    kw = dataclass_kwargs(a, WorkerConfig)
    kw["served_models"] = served_names(a.model, a.served_models)
    kw["model_name"] = a.model_name or primary_name(a.model, a.served_models)
    return WorkerConfig(**kw)


def log_engine_choice(engine) -> None:
    """One line at start: what the engine runs on (device, dtype, kernels, KV capacity)."""
    log.info("engine: %s", engine.describe())


def build_engine(model: str, factory: str | None = None, **kwargs):
    """The engine a worker serves: `LLM(model, ...).llm_engine`, or a test factory."""
    if factory:
        mod, _, fn = factory.partition(":")
        return getattr(importlib.import_module(mod), fn)(model=model, **kwargs)
    from genpool.engine import LLM

    return LLM(model, **kwargs).llm_engine


def served_names(model: str, extra) -> frozenset[str]:
    if extra:
        return frozenset(extra)
    # a local checkpoint is served (and advertised, in /v1/models) by its directory's name only:
    # its path would tell every caller about this machine's filesystem
    names = {Path(model).name} if Path(model).expanduser().exists() else {model, Path(model).name}
    if Path(model).suffix.lower() == ".gguf":  # a local GGUF file: also without its extension
        names.add(Path(model).stem)
    try:
        from genpool.engine.models.registry import lookup

        spec = lookup(model)
        if spec is not None:
            names |= {spec.name, *spec.aliases}
    except ImportError:
        pass
    return frozenset(n for n in names if n)


def primary_name(model: str, extra: list[str] | None) -> str:
    """The one name the pool shows for this model: the first --served-model-name, else the
    registry name, else the checkpoint directory's name (as vLLM)."""
    if extra:
        return extra[0]
    try:
        from genpool.engine.models.registry import lookup

        spec = lookup(model)
        if spec is not None:
            return spec.name
    except ImportError:
        pass
    return Path(model).name or model


def cmd_worker(a: argparse.Namespace) -> int:
    from genpool.schemas import Keys
    from genpool.schemas.connection import connect
    from genpool.workers.integrations.embedded import ensure_redis
    from genpool.workers.worker import Worker

    logging.basicConfig(level=a.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    url, _ = ensure_redis(a.redis)
    from genpool.schemas.config import key_prefix

    engine = build_engine(a.model, a.engine_factory, **engine_kwargs(a))
    log_engine_choice(engine)
    cfg = worker_config(a)
    r = connect(url, socket_connect_timeout=5)  # socket_timeout: connect()'s 30 s default
    keys = Keys(key_prefix(a.prefix), lane_shards=cfg.lane_shards)
    return run_worker(Worker(engine, r, keys, cfg), a, url)
