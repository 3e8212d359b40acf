"""The import rules of docs/design.md's map, checked on the source: a line of code knows its room.

Every module of the product folders is parsed (not imported) and each absolute import is checked
against what its folder may import. A new import that crosses a wall fails here with the file,
line and rule, so the map in docs/design.md stays true.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = {"engine", "kernels", "workers", "producer", "schemas"}
HEAVY = {"torch", "triton", "transformers", "tokenizers", "safetensors", "numpy", "gguf", "celery",
         "prometheus_client", "kombu", "flower"}

# folder (or sub-package) -> product folders and heavy libraries it must NOT import
FORBIDDEN = {
    "schemas": PRODUCT - {"schemas"} | HEAVY,
    "producer": PRODUCT - {"producer", "schemas"} | HEAVY,
    "kernels": {"engine", "workers", "producer"},
    "engine": {"workers", "producer"},
    "workers": {"producer"},  # the loop's stages: only engine + schemas (shared plumbing lives there)
    "workers/integrations": set(),  # Celery, Flower, Prometheus, embedded Redis: the front doors
    "workers/cli": set(),
}


def _room(rel: Path) -> str:
    sub = "/".join(rel.parts[:2])
    return sub if sub in FORBIDDEN else rel.parts[0]


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


def _modules():
    for top in sorted(PRODUCT):
        yield from sorted((ROOT / top).rglob("*.py"))


def test_every_product_module_is_checked():
    rooms = {_room(p.relative_to(ROOT)) for p in _modules()}
    assert rooms == set(FORBIDDEN), rooms ^ set(FORBIDDEN)


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_imports_stay_inside_their_room(room):
    wrong = []
    for path in _modules():
        rel = path.relative_to(ROOT)
        if _room(rel) != room:
            continue
        for line, mod in _imports(path):
            if _folder(mod) in FORBIDDEN[room]:
                wrong.append(f"{rel}:{line} imports {mod}")
    assert not wrong, f"{room} may not import {sorted(FORBIDDEN[room])}:\n" + "\n".join(wrong)


def _folder(mod: str) -> str:
    """The product folder (or heavy library) an import names: genpool.engine.x -> engine."""
    parts = mod.split(".")
    return parts[1] if parts[0] == "genpool" and len(parts) > 1 else parts[0]


def _everything_python():
    for top in (*sorted(PRODUCT), "tests", "benchmarks", "examples", "docs"):
        yield from sorted((ROOT / top).rglob("*.py"))


def test_no_top_level_product_imports():
    """Product folders import only as genpool.*: a bare `engine` / `kernels` ... resolves to
    whatever distribution owns that top-level name (transformers 5.25 ships a `kernels`)."""
    bare = [f"{p.relative_to(ROOT)}:{line} imports {mod}" for p in _everything_python()
            for line, mod in _imports(p) if mod.split(".")[0] in PRODUCT]
    assert not bare, "\n".join(bare)


def test_the_wheel_lists_every_package():
    """pyproject.toml's explicit package list (the genpool.* mapping) names every folder with an
    __init__.py, so a new sub-package cannot be left out of wheels and regular installs."""
    import tomllib
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {"genpool." + ".".join(p.parent.relative_to(ROOT).parts)
               for top in PRODUCT for p in (ROOT / top).rglob("__init__.py")}
    assert set(cfg["packages"]) == on_disk, set(cfg["packages"]) ^ on_disk
    assert cfg["package-dir"] == {f"genpool.{t}": t for t in PRODUCT}


def test_a_forbidden_import_is_caught(tmp_path):
    """The checker itself: a schemas module importing torch is reported (the rule can fail)."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom torch import nn\n")
    assert [m for _, m in _imports(bad) if m.split(".")[0] in FORBIDDEN["schemas"]] == ["torch"]


def test_nothing_in_the_product_pickles():
    """The wire is JSON only (docs/protocol.md), Celery included: no product module imports a
    pickling library or calls torch.distributed's object collectives (which pickle)."""
    banned_mods = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
    banned_calls = {"broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                    "send_object_list", "recv_object_list"}
    wrong = []
    for path in _modules():
        tree = ast.parse(path.read_text())
        rel = path.relative_to(ROOT)
        wrong += [f"{rel}:{line} imports {name}" for line, name in _imports(path)
                  if name.split(".")[0] in banned_mods]
        wrong += [f"{rel}:{n.lineno} calls {n.attr}" for n in ast.walk(tree)
                  if isinstance(n, ast.Attribute) and n.attr in banned_calls]
    assert not wrong, "\n".join(wrong)


def test_celery_accepts_and_sends_json_only():
    pytest.importorskip("celery")
    from genpool.workers.integrations.celery_app import app
    c = app.conf
    assert (c.task_serializer, c.result_serializer, c.event_serializer) == ("json", "json", "json")
    assert list(c.accept_content) == ["json"] and list(c.result_accept_content) == ["json"]
