"""`genpool batch` and `genpool gateway` (their modules are imported only when a command runs, so
`genpool gateway --help` works without fastapi installed)."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .cli import add_connection_args


def register_batch(sub) -> None:
    p = sub.add_parser("batch", help="run an OpenAI Batch API .jsonl file through the pool "
                                     "(resumable: rerun the same command after a stop)")
    p.add_argument("input", type=Path, help="input .jsonl: custom_id, method, url, body per line")
    p.add_argument("-o", "--output", type=Path, required=True,
                   help="output .jsonl; custom_ids already in it are skipped")
    p.add_argument("--max-in-flight", type=int, default=64, help="jobs queued or running at once")
    p.add_argument("--model", default=None, help="model for lines whose body names none")
    p.add_argument("--priority", type=int, default=1, help="> 0: the bulk lane (default 1)")
    p.add_argument("--batch-id", default=None,
                   help="namespace for job ids (default: a hash of the input file's content)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_connection_args(p)
    p.set_defaults(func=cmd_batch)


def cmd_batch(a: argparse.Namespace) -> int:
    from .batch import run_batch
    from .client import Client

    if not a.input.is_file():
        print(f"genpool batch: no such file: {a.input}", file=sys.stderr)
        return 2
    try:
        c = run_batch(a.input, a.output, client=Client(a.redis, a.prefix),
                      max_in_flight=a.max_in_flight, model=a.model, priority=a.priority,
                      batch_id=a.batch_id, progress=not a.no_progress)
    except KeyboardInterrupt:
        print("\ngenpool batch: interrupted; rerun the same command to resume (jobs in flight "
              "keep running and are picked up)", file=sys.stderr)
        return 130
    print(f"genpool batch: {c.ok} completed, {c.errors} errors, {c.skipped} unusable lines "
          f"skipped, {c.resumed} already in {a.output}", file=sys.stderr)
    return 0


def register_gateway(sub) -> None:
    p = sub.add_parser("gateway", help="OpenAI-compatible HTTP server in front of the pool")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", action="extend", nargs="+", default=None, metavar="KEY",
                   help="accepted bearer keys (default $GENPOOL_API_KEYS, comma-separated; "
                        "none: no auth)")
    p.add_argument("--max-queue-depth", type=int, default=None,
                   help="answer 429 while more jobs than this wait for a worker")
    p.add_argument("--priority", type=int, default=-1,
                   help="job priority (default -1: the interactive lane)")
    p.add_argument("--model", default=None, help="model for requests that name none")
    p.add_argument("--log-level", default="info")
    add_connection_args(p)
    p.set_defaults(func=cmd_gateway)


def cmd_gateway(a: argparse.Namespace) -> int:
    import uvicorn

    from .gateway import create_app

    keys = a.api_key or [k for k in os.environ.get("GENPOOL_API_KEYS", "").split(",") if k]
    app = create_app(a.redis, a.prefix, api_keys=keys, max_queue_depth=a.max_queue_depth,
                     priority=a.priority, default_model=a.model)
    uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level.lower())
    return 0
