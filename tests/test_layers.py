"""The packages' import rules (docs/design.md §2): the transports sit above the core.

Read from the source with :mod:`ast` (every import, also those inside functions): no module of
``pipeline`` imports ``transports`` or ``backends`` except the command line, ``transports.cli``,
which is a face above all of them; and nothing in ``stages`` or ``backends`` imports
``transports`` or the command line.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def _offenders(package: str, forbidden: tuple[str, ...], allowed: tuple[str, ...] = ()
               ) -> list[str]:
    out = []
    for path in sorted((SRC / package).rglob("*.py")):
        module = ".".join(path.relative_to(SRC).with_suffix("").parts)
        if allowed and module.startswith(allowed):
            continue
        for name in sorted(_imports(path)):
            if name.startswith(forbidden):
                out.append(f"{module} imports {name}")
    return out


def test_the_core_never_imports_the_transports() -> None:
    assert _offenders("pipeline", ("transports",), allowed=("pipeline.__main__",)) == []


def test_the_core_never_imports_a_backend() -> None:
    # a backend's knowledge (a GGUF file's metadata, say) reaches the core through the
    # build's context or a protocol, never an import
    assert _offenders("pipeline", ("backends",), allowed=("pipeline.__main__",)) == []


def test_stages_and_backends_import_neither_transports_nor_the_command_line() -> None:
    for package in ("stages", "backends"):
        assert _offenders(package, ("transports", "transports.cli")) == [], package


def test_the_rule_sees_an_import_inside_a_function(tmp_path: Path) -> None:
    # the checker itself: an import in a function body counts, a relative one is ignored
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from transports.http import serve\n    from . import x\n")
    assert _imports(module) == {"transports.http"}
