"""`genpool models pull NAME` / `genpool models list` / `genpool models path NAME`."""
from __future__ import annotations

import logging
import sys
from contextlib import contextmanager

from genpool.schemas.config import HELP_FMT


def register(sub) -> None:
    p = sub.add_parser("models", help="list, pull or locate known models",
                       description="The models genpool knows by name (its registry), where they "
                       "are cached ($GENPOOL_HOME/models, GENPOOL_HOME default ~/.cache/genpool), "
                       "and fetching one ahead of `genpool worker`.", formatter_class=HELP_FMT)
    msub = p.add_subparsers(dest="models_command", metavar="ACTION")
    pl = msub.add_parser("pull", help="download + convert a registry model into the cache",
                         formatter_class=HELP_FMT)
    pl.add_argument("name", help="registry name or alias (see `genpool models list`)")
    pl.add_argument("--force", action="store_true", help="re-convert even if cached (default: off)")
    pl.set_defaults(func=cmd_pull)
    ls = msub.add_parser("list", help="known model names, aliases and cache state",
                         formatter_class=HELP_FMT)
    ls.set_defaults(func=cmd_list)
    pa = msub.add_parser("path", help="print the local path of a model (no download)",
                         formatter_class=HELP_FMT)
    pa.add_argument("name", help="registry name, alias or local checkpoint dir")
    pa.set_defaults(func=cmd_path)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def cmd_pull(args) -> int:
    from genpool.engine.models import registry

    try:
        with phases_on_stderr():
            path = registry.pull(args.name, force=args.force)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)  # alone on stdout, for scripts: the phases went to stderr
    return 0


@contextmanager
def phases_on_stderr():
    """Print the pull's phases (logger genpool.models, INFO) while the command runs: a first
    conversion is half a minute, which must not pass in silence. Undone after, so a caller in
    the same process keeps its own logging."""
    log = logging.getLogger("genpool.models")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("genpool models: %(message)s"))
    level, propagate = log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False  # once, not also through a root handler someone configured
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate


def cmd_list(args) -> int:
    from genpool.engine.models import registry

    for name in registry.known_names():
        spec = registry.REGISTRY[name]
        path = registry.model_path(name)
        state = "pulled" if registry.is_pulled(name) else "not pulled"
        print(f"{name}\t{state}\t{path}\taliases: {', '.join(spec.aliases)}")
    return 0


def cmd_path(args) -> int:
    from genpool.engine.models import registry

    try:
        print(registry.resolve_model(args.name, download=False))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
