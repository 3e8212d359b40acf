"""`genpool` console script: a thin dispatcher over lazily imported subcommand modules.

Each entry of COMMANDS maps a subcommand name to "module:function"; the function receives the
argparse subparsers object and adds its parser (setting `func` via set_defaults). Modules are
imported only when building the parser, and must keep their own heavy imports (torch, engine)
inside the command functions, so `genpool submit` works without torch installed.
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, str] = {
    "models": "workers.cli_models:register",
    "submit": "producer.cli:register_submit",
    "status": "producer.cli:register_status",
    "worker": "workers.worker_cli:register_worker",
    "demo": "workers.demo:register",
    "batch": "producer.cli_bulk:register_batch",
    "gateway": "producer.cli_bulk:register_gateway",
}


def _load(target: str):
    mod, _, fn = target.partition(":")
    return getattr(importlib.import_module(mod), fn)


def build_parser(load=None) -> argparse.ArgumentParser:
    """Parser with every command; `load` (names) limits which modules get imported (None: all)."""
    parser = argparse.ArgumentParser(prog="genpool", description="genpool: Redis-streams LLM worker pool")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, target in COMMANDS.items():
        if load is not None and name not in load:
            # cheap placeholder so `genpool --help` lists it without importing its module
            sub.add_parser(name, help=f"(see `genpool {name} --help`)")
            continue
        try:
            _load(target)(sub)
        except ImportError as e:  # a command whose optional deps are missing stays visible
            p = sub.add_parser(name, help=f"unavailable: {e}")
            p.set_defaults(func=lambda args, _e=e, _n=name: _unavailable(_n, _e))
    return parser


def _unavailable(name: str, err: Exception) -> int:
    print(f"genpool {name}: unavailable ({err})", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # import only the chosen subcommand's module; plain `genpool` / `--help` imports none
    first = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(load={first} if first in COMMANDS else set())
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 0 if args.command is None else 2
    rc = func(args)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
