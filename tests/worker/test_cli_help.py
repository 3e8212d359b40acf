"""Every `genpool` command and option has a help line, and every option shows its default.

Walks the real argparse tree (build_parser() with every command module loaded), so a new command
or option, or a new EngineConfig / WorkerConfig field, is checked without listing it here.
An option whose default is None must say in its help what none means ("default: none: ...");
one with a real default must show that value.
"""
from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from genpool.engine.config import EngineConfig
from genpool.workers.cli.main import COMMANDS, build_parser
from genpool.workers.worker_config import WorkerConfig


def walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("genpool",)):
    """(command path, parser, {subcommand: its one-line help}) for the parser and every subparser."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {ca.dest: ca.help for ca in action._choices_actions}
            yield path, parser, helps
            for name, sub in action.choices.items():
                yield from walk(sub, path + (name,))
            return
    yield path, parser, {}


def tree():
    return list(walk(build_parser()))


def expanded_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help line exactly as `--help` prints it (the parser's own formatter, %(default)s filled)."""
    fmt = parser._get_formatter()
    return fmt._expand_help(action) if action.help else ""


def shown_actions(parser):
    for a in parser._actions:
        if a.help == argparse.SUPPRESS or \
                isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        yield a


def trivial(default) -> bool:
    """Defaults that need not be spelled out: none (checked separately), flags that are off."""
    return default is None or default is False or default == argparse.SUPPRESS


def name_of(path, action) -> str:
    return " ".join(path) + " " + ("/".join(action.option_strings) or action.dest)


def test_every_command_module_loads():
    """An 'unavailable' placeholder would hide a command's options from this check."""
    paths = {p for p, _, _ in tree()}
    assert {("genpool", c) for c in COMMANDS} <= paths
    _, _, top = tree()[0]
    bad = {c: h for c, h in top.items() if not h or h.startswith("unavailable")}
    assert not bad, bad


def test_every_command_has_a_help_line():
    missing = [" ".join(path + (name,)) for path, _, helps in tree()
               for name, h in helps.items() if not (h or "").strip()]
    assert not missing, f"commands without a help line: {missing}"


def test_every_argument_has_help():
    missing = [name_of(path, a) for path, p, _ in tree() for a in shown_actions(p)
               if not expanded_help(p, a).strip()]
    assert not missing, f"arguments without help: {missing}"


def test_every_option_shows_its_default():
    problems = []
    for path, p, _ in tree():
        for a in shown_actions(p):
            if not a.option_strings or a.required or a.nargs == 0 and trivial(a.default):
                continue  # positionals, required options, flags that are off by default
            h = expanded_help(p, a)
            if "default" not in h.lower():
                problems.append(f"{name_of(path, a)}: no default shown ({h!r})")
            elif not trivial(a.default) and str(a.default) not in h and \
                    not (isinstance(a.default, bool) and re.search(r"default: (on|off)", h)):
                problems.append(f"{name_of(path, a)}: default {a.default!r} not shown ({h!r})")
            if h.count("(default:") > 1:
                problems.append(f"{name_of(path, a)}: default shown twice ({h!r})")
    assert not problems, "\n".join(problems)


def test_help_renders_for_every_command():
    for path, p, _ in tree():
        text = p.format_help()  # a stray % in a help string would raise here
        assert text.startswith("usage: " + " ".join(path)), path


def _worker_parser():
    return dict((path, p) for path, p, _ in tree())[("genpool", "worker")]


@pytest.mark.parametrize("cls", [EngineConfig, WorkerConfig])
def test_dataclass_options_keep_their_defaults_visible(cls):
    """Options derived from config fields (engine/config_args.py) show the field's default."""
    p = _worker_parser()
    by_dest = {a.dest: a for a in shown_actions(p)}  # not the hidden aliases (--no-prefix-caching)
    problems = []
    for f in dataclasses.fields(cls):
        if not f.metadata.get("cli", True):  # bookkeeping, not an option (EngineConfig.setting_sources)
            continue
        a = by_dest[f.name]
        h = expanded_help(p, a)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            assert a.required, f.name
            continue
        if "default" not in h:
            problems.append(f"--{f.name}: {h!r}")
        elif f.default not in (None, "", frozenset(), dataclasses.MISSING) and str(f.default) not in h:
            problems.append(f"--{f.name}: default {f.default!r} missing from {h!r}")
    assert not problems, problems


def test_gateway_priority_is_described_as_a_ceiling():
    p = dict((path, p) for path, p, _ in tree())[("genpool", "gateway")]
    (prio,) = [a for a in p._actions if a.dest == "priority"]
    h = expanded_help(p, prio)
    assert "ceiling" in h and "-1" in h and "400" in h
    assert "ceiling" in p.format_help()


def test_model_arguments_say_what_they_take():
    for cmd in ("pull", "path"):
        p = dict((path, p) for path, p, _ in tree())[("genpool", "models", cmd)]
        (name,) = [a for a in p._actions if a.dest == "name"]
        assert "registry name" in name.help
