"""Print the source tree's shape: lines per package and subpackage, and the import circles.

``python scripts/shape.py`` (from the checkout's root) prints a table of the Python lines under
``src/`` by top-level package and by the subpackage or module one level down, and every
circle of imports between those units (imports inside functions and ``TYPE_CHECKING``
blocks included, and marked when only they close it). docs/architecture.md quotes
its output; ``--json`` writes the same as JSON.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGES = ("pipeline", "stages", "backends", "transports")


def unit(module: str) -> str:
    """A module's unit: its first two parts (``pipeline.engine``, ``stages.select``,
    ``pipeline.grammar``)."""
    return ".".join(module.split(".")[:2])


def modules() -> dict[str, Path]:
    """Every module of the four packages, by dotted name."""
    found = {}
    for package in PACKAGES:
        for path in sorted((SRC / package).rglob("*.py")):
            found[".".join(path.relative_to(SRC).with_suffix("").parts)] = path
    return found


def lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def imports(path: Path, at_load: bool = False) -> set[str]:
    """The modules of the four packages ``path`` imports: every import, or (``at_load``) only
    those that run when the module loads (at its top level, not under ``TYPE_CHECKING``)."""
    out = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body if at_load else ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return {name for name in out if name.split(".")[0] in PACKAGES}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one unit (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def shape() -> dict[str, object]:
    found = modules()
    per_unit: dict[str, int] = defaultdict(int)
    per_package: dict[str, int] = defaultdict(int)
    edges: dict[str, set[str]] = defaultdict(set)
    at_load: dict[str, set[str]] = defaultdict(set)
    for name, path in found.items():
        n = lines(path)
        per_unit[unit(name)] += n
        per_package[name.split(".")[0]] += n
        for graph, only_load in ((edges, False), (at_load, True)):
            for target in imports(path, only_load):
                if unit(target) != unit(name):
                    graph[unit(name)].add(unit(target))
    return {"total": sum(per_package.values()), "packages": dict(per_package),
            "units": dict(sorted(per_unit.items())), "circles": circles(edges),
            "circles_at_load": circles(at_load)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    figures = shape()
    print(f"src/: {figures['total']:,} lines")
    packages = figures["packages"]
    units = figures["units"]
    assert isinstance(packages, dict) and isinstance(units, dict)
    for package, n in packages.items():
        print(f"\n{package:<28}{n:>7,}")
        for name, m in units.items():
            if name.split(".")[0] == package and name != package:
                print(f"  {name:<26}{m:>7,}")
    found = figures["circles"]
    assert isinstance(found, list)
    loading = figures["circles_at_load"]
    assert isinstance(loading, list)
    print(f"\nimport circles between units: {len(found)} "
          f"({len(loading)} among the imports that run when a module loads)")
    for group in found:
        print("  " + " <-> ".join(group))
    for group in loading:
        print("  at load: " + " <-> ".join(group))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
