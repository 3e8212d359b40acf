"""Lines per top-level folder and the longest functions (issue 17's before/after measure).

    python benchmarks/code_shape.py [--top 5]

Counts non-blank lines of .py/.c/.h files under each product folder, and ranks Python functions
by their length in lines (decorators excluded), from the source tree this file sits in.
"""
from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("engine", "kernels", "workers", "producer", "schemas", "tests", "benchmarks", "examples")


def files(folder: str):
    for p in sorted((ROOT / folder).rglob("*")):
        if p.suffix in (".py", ".c", ".h") and "__pycache__" not in p.parts:
            yield p


def functions(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.end_lineno - node.lineno + 1, f"{path.relative_to(ROOT)}:{node.name}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=5, help="how many of the longest functions (default 5)")
    args = ap.parse_args()
    print(f"{'folder':<12} {'files':>5} {'lines':>7} {'largest file (lines)':<50}")
    longest = []
    for folder in FOLDERS:
        sizes = [(sum(1 for ln in p.read_text().splitlines() if ln.strip()), p) for p in files(folder)]
        if not sizes:
            continue
        big = max(sizes)
        print(f"{folder:<12} {len(sizes):>5} {sum(n for n, _ in sizes):>7} "
              f"{str(big[1].relative_to(ROOT))} ({big[0]})")
        if folder not in ("tests", "benchmarks", "examples"):
            longest += [f for _, p in sizes if p.suffix == ".py" for f in functions(p)]
    print("\nlongest product functions (engine, kernels, workers, producer, schemas):")
    for n, name in sorted(longest, reverse=True)[:args.top]:
        print(f"  {n:>4}  {name}")


if __name__ == "__main__":
    main()
