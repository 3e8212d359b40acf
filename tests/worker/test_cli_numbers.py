"""Number options refuse what they cannot mean, at parse time (exit 2 with the option named).

`--timeout nan` waited for ever, `--no-worker-grace nan` held a request's slot for ever, a
negative `--celery-concurrency` failed only after the model had loaded, and `lanes repair
--ahead-s -3600` took every entry of the last hour for poison and rewrote it. Walks the real
argparse tree, so a new option is checked without listing it here."""
from __future__ import annotations

import argparse

import pytest

from tests.worker.test_cli_help import tree

NUMBER_TYPES = (float, int)


def number_options():
    for path, parser, _ in tree():
        for a in parser._actions:
            if a.option_strings and a.type is not None and (
                    a.type in NUMBER_TYPES or getattr(a.type, "number", False)):
                yield " ".join(path), a


def refuses(action, text: str) -> bool:
    try:
        action.type(text)
    except (argparse.ArgumentTypeError, ValueError, TypeError):
        return True
    return False


def test_no_number_option_takes_nan_or_infinity():
    taken = [f"{cmd} {a.option_strings[-1]} {bad}" for cmd, a in number_options()
             for bad in ("nan", "inf", "-inf") if not refuses(a, bad)]
    assert not taken, taken


@pytest.mark.parametrize("option", ["--timeout", "--ahead-s", "--no-worker-grace",
                                    "--no-worker-wait", "--celery-concurrency", "--max-in-flight",
                                    "--count", "--limit", "--deadline-s", "--batch-window",
                                    "--batch-webhook-backoff", "--header-timeout"])
def test_counts_and_durations_refuse_negatives(option):
    found = [(cmd, a) for cmd, a in number_options() if option in a.option_strings]
    assert found, option
    for cmd, a in found:
        assert refuses(a, "-3"), f"genpool {cmd} {option} -3"
