"""Command-line options derived from config dataclasses (as vLLM's EngineArgs.add_cli_args does).

A field `max_num_seqs: int = 64` with `metadata={"help": ...}` becomes `--max-num-seqs N` (type, default
and help from the field). Metadata may add `choices`, `aliases` (more option strings) and, for
booleans, `off_aliases` (option strings that set it False; `--no-<name>` always does); `cli: False`
keeps a field off the command line. A field with a row in schemas/settings.py (an environment
variable) defaults to None, "not given", and its help names the variable and the row's default.
Options are never listed by hand, so a field cannot be forgotten by a CLI.
"""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from genpool.schemas.config import finite
from genpool.schemas.settings import help_default, row_for


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _scalar_type(hint):
    """int | None -> int; frozenset[str] -> str (repeatable); plain types as they are."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        return _scalar_type(args[0])
    return hint


def add_dataclass_args(group, cls) -> None:
    """One option per field of dataclass `cls` on argparse group/parser `group`."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if not meta.get("cli", True):
            continue
        kind = _scalar_type(hints[f.name])
        opts = (flag(f.name), *meta.get("aliases", ()))
        kw: dict = {"dest": f.name, "help": meta.get("help")}
        if f.default is not dataclasses.MISSING:
            kw["default"] = f.default
            # the default shows in the help, unless the help already says it (a None or empty
            # default must: its help tells what none means, e.g. "(default: none: every core)")
            if f.default not in (None, frozenset(), "") and kw["help"] and "default" not in kw["help"]:
                kw["help"] += " (default: %(default)s)"
            row = row_for(cls.__name__, f.name)
            if row is not None and kw["help"]:
                kw["help"] += f" ({help_default(row)})"
        elif f.default_factory is not dataclasses.MISSING:
            kw["default"] = None  # the dataclass makes it (e.g. a per-process name)
        else:
            kw["required"] = True
        if kind is bool:
            group.add_argument(*opts, action=argparse.BooleanOptionalAction, **kw)
            for off in meta.get("off_aliases", ()):
                group.add_argument(off, dest=f.name, action="store_false", help=argparse.SUPPRESS)
            continue
        if typing.get_origin(kind) in (frozenset, list, tuple, set):
            (item,) = typing.get_args(kind)[:1]
            kw.update(action="append", type=item, default=None)
        else:
            kw["type"] = finite if kind is float else kind  # no NaN or infinity (schemas/config.py)
            if "choices" in meta:
                kw["choices"] = meta["choices"]
        group.add_argument(*opts, **kw)


def dataclass_kwargs(ns: argparse.Namespace, cls, skip: tuple[str, ...] = ()) -> dict:
    """The fields of `cls` found on `ns`, converted back to the field types; options left at None
    for fields with a default factory are omitted (the dataclass makes them)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if f.name in skip or not hasattr(ns, f.name) or not f.metadata.get("cli", True):
            continue
        value = getattr(ns, f.name)
        if value is None and f.default_factory is not dataclasses.MISSING:
            continue
        origin = typing.get_origin(_scalar_type(hints[f.name]))
        if value is not None and origin in (frozenset, set, tuple):
            value = origin(value)
        out[f.name] = value
    return out
