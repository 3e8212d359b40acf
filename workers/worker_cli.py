"""`genpool worker`: one resident engine serving one prefix's lane streams."""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from pathlib import Path

from producer.cli import add_connection_args

from .worker_runner import add_runner_args, run_worker

ENGINE_OPTS = ("dtype", "block_size", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks",
               "max_model_len", "kernel_backend", "num_threads", "seed", "enable_prefix_caching")


def register_worker(sub) -> None:
    p = sub.add_parser("worker", help="run a resident worker: Redis lane streams -> engine")
    p.add_argument("--model", required=True, help="registry name or local HF checkpoint dir")
    p.add_argument("--served-model-name", action="append", default=None,
                   help="name(s) jobs may ask for (default: --model and the checkpoint dir name)")
    p.add_argument("--name", default=None, help="consumer name (default host-pid)")
    add_connection_args(p)
    add_engine_args(p)
    g = p.add_argument_group("queue")
    g.add_argument("--claim-idle-ms", type=int, default=30_000,
                   help="reclaim entries another worker has held this long without progress")
    g.add_argument("--max-deliveries", type=int, default=3,
                   help="dead-letter a job delivered more often than this")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds to finish in-flight jobs after SIGTERM")
    g.add_argument("--high-burst", type=int, default=4,
                   help="interactive jobs admitted beyond capacity (the engine preempts for them)")
    g.add_argument("--max-inflight", type=int, default=None,
                   help="jobs held at once (default: the engine's max_num_seqs)")
    g.add_argument("--heartbeat-s", type=float, default=2.0)
    g.add_argument("--result-ttl", type=int, default=86400, help="seconds results are kept")
    g.add_argument("--engine-factory", default=None, help=argparse.SUPPRESS)  # tests: module:fn
    g.add_argument("--log-level", default=os.environ.get("GENPOOL_LOG_LEVEL", "INFO"))
    add_runner_args(p)  # --metrics-port, --celery-events, --celery (workers/worker_runner.py)
    p.set_defaults(func=cmd_worker)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="float32")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=1024)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--kernel-backend", default="auto", choices=["auto", "cpu", "torch", "triton"],
                   help="auto: triton on CUDA, cpu (C kernels) on the CPU when a C compiler is present, else torch")
    g.add_argument("--num-threads", type=int, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")


def engine_kwargs(a: argparse.Namespace) -> dict:
    return {k: getattr(a, k) for k in ENGINE_OPTS if getattr(a, k, None) is not None}


def build_engine(model: str, factory: str | None = None, **kwargs):
    """The engine a worker serves: `LLM(model, ...).llm_engine`, or a test factory."""
    if factory:
        mod, _, fn = factory.partition(":")
        return getattr(importlib.import_module(mod), fn)(model=model, **kwargs)
    from engine import LLM

    return LLM(model, **kwargs).llm_engine


def served_names(model: str, extra: list[str] | None) -> frozenset[str]:
    if extra:
        return frozenset(extra)
    names = {model, Path(model).name}
    try:
        from engine.models.registry import lookup

        spec = lookup(model)
        if spec is not None:
            names |= {spec.name, *spec.aliases}
    except ImportError:
        pass
    return frozenset(n for n in names if n)


def cmd_worker(a: argparse.Namespace) -> int:
    import redis

    from schemas import Keys

    from .embedded import ensure_redis
    from .worker import Worker, WorkerConfig

    logging.basicConfig(level=a.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    url, _ = ensure_redis(a.redis)
    from producer.config import key_prefix

    engine = build_engine(a.model, a.engine_factory, **engine_kwargs(a))
    cfg = WorkerConfig(served_models=served_names(a.model, a.served_model_name),
                       claim_idle_ms=a.claim_idle_ms, max_deliveries=a.max_deliveries,
                       drain_timeout_s=a.drain_timeout, high_burst=a.high_burst,
                       heartbeat_s=a.heartbeat_s, max_inflight=a.max_inflight,
                       result_ttl_s=a.result_ttl)
    if a.name:
        cfg.name = a.name
    r = redis.Redis.from_url(url, socket_timeout=30, socket_connect_timeout=5)
    return run_worker(Worker(engine, r, Keys(key_prefix(a.prefix)), cfg), a, url)
