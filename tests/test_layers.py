"""The packages' import rules (docs/architecture.md, "Layers"): an import tells a reader where a
module sits.

Read from the source with :mod:`ast`, every import counts, also those inside functions. From
the bottom up:

- ``pipeline`` is the library: it imports nothing from ``stages``, ``backends`` or
  ``transports`` (``python -m pipeline``, :mod:`pipeline.__main__`, is the one entry point that
  hands over to the command line). Within it, ``pipeline.contracts`` imports only the errors,
  the events and the grammar; the engine (one decode step) builds nothing: it imports neither
  the builder, nor a pipeline, nor the runtime that supervises it.
- ``stages`` and ``backends`` implement the contracts: they import ``pipeline`` (not its
  builder, its pipeline or its engine's internals), never each other and never ``transports``.
- ``transports`` (the HTTP server, the command line, Ray) may import everything.
- Nobody imports another package's private module or private name (``_name``).

A ``TYPE_CHECKING`` import counts as well, but one inside ``pipeline`` may point to a module of
``pipeline`` above it: a type annotation is not a dependency at run time.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGES = ("pipeline", "stages", "backends", "transports")

RULES: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    # (importer, imports it may not make, importers the rule leaves out)
    ("pipeline", ("stages", "backends", "transports"), ("pipeline.__main__",)),
    ("pipeline.contracts", ("pipeline.engine", "pipeline.builder", "pipeline.pipe",
                            "pipeline.runtime", "pipeline.registry", "pipeline.tools",
                            "pipeline.trace", "pipeline.options"), ()),
    ("pipeline.engine", ("pipeline.builder", "pipeline.pipe", "pipeline.runtime",
                         "pipeline.registry", "pipeline.tools", "pipeline.trace"), ()),
    ("stages", ("backends", "transports", "pipeline.builder", "pipeline.pipe",
                "pipeline.runtime", "pipeline.engine"), ()),
    ("backends", ("stages", "transports", "pipeline.builder", "pipeline.pipe",
                  "pipeline.runtime", "pipeline.engine"), ()),
)


MOVING: frozenset[str] = frozenset({
    "backends.torch.backend imports pipeline.engine.blocks",
})
"""Wrong-way imports the redesign in progress removes, step by step: each must still occur
(a removed one is struck from here), and no other may appear."""


def _module(path: Path) -> str:
    return ".".join(path.relative_to(SRC).with_suffix("").parts)


def _imports(path: Path) -> list[tuple[str, tuple[str, ...], bool]]:
    """Each import in ``path``: the module, the names taken from it, and whether it sits in an
    ``if TYPE_CHECKING:`` block."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
                   for child in node.body for n in ast.walk(child)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, (), id(node) in typing_only) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.module, tuple(a.name for a in node.names),
                          id(node) in typing_only))
    return found


def _ours() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (SRC / package).rglob("*.py"))


def _owner(name: str) -> str:
    """The package a module belongs to: its first two parts where the second is a subpackage
    (``stages.select``, ``pipeline.engine``), else the top package (``pipeline.grammar`` is
    ``pipeline``'s)."""
    parts = name.split(".")
    if len(parts) > 1 and (SRC / parts[0] / parts[1]).is_dir():
        return ".".join(parts[:2])
    return parts[0]


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize("importer,forbidden,left_out", RULES,
                         ids=[rule[0] for rule in RULES])
def test_no_import_points_the_wrong_way(importer: str, forbidden: tuple[str, ...],
                                        left_out: tuple[str, ...]) -> None:
    wrong = []
    for path in _ours():
        module = _module(path)
        if not _within(module, importer) or any(_within(module, m) for m in left_out):
            continue
        for name, _, typing_only in _imports(path):
            inside = name.split(".")[0] == module.split(".")[0] == "pipeline"
            if any(_within(name, f) for f in forbidden) and not (typing_only and inside):
                wrong.append(f"{module} imports {name}")
    _judge(wrong, [m for m in MOVING if _within(m.split()[0], importer)
                   and not any(_within(m.split()[0], x) for x in left_out)
                   and any(_within(m.split()[2], f) for f in forbidden)])


def _judge(wrong: list[str], moving: list[str]) -> None:
    new = sorted(set(wrong) - MOVING)
    gone = sorted(set(moving) - set(wrong))
    assert not new, "\n".join(new)
    assert not gone, "no longer imported, strike from MOVING: " + "\n".join(gone)


def test_no_module_reaches_into_another_packages_private_parts() -> None:
    # a private module (a path part starting with one underscore) or a private name belongs
    # to its own package (:func:`_owner`)
    wrong = []
    for path in _ours():
        module = _module(path)
        for name, taken, _ in _imports(path):
            if name.split(".")[0] not in PACKAGES or _owner(name) == _owner(module):
                continue
            private_module = any(p.startswith("_") and not p.startswith("__")
                                 for p in name.split("."))
            private_names = [t for t in taken if t.startswith("_") and not t.startswith("__")]
            if private_module or private_names:
                wrong.append(f"{module} imports {name} {private_names or ''}".rstrip())
    _judge(wrong, [m for m in MOVING if "['_" in m])


def test_the_rules_see_every_kind_of_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    # the checker itself: an import in a function body counts, a relative one is ignored, a
    # TYPE_CHECKING one is marked as such
    module = tmp_path / "m.py"
    module.write_text("from typing import TYPE_CHECKING\n"
                      "if TYPE_CHECKING:\n    from pipeline.builder import build\n"
                      "def f():\n    from transports.http import serve\n    from . import x\n")
    assert _imports(module) == [("typing", ("TYPE_CHECKING",), False),
                                ("pipeline.builder", ("build",), True),
                                ("transports.http", ("serve",), False)]
    # and a planted wrong-way import fails the rule
    fake = tmp_path / "src"
    (fake / "pipeline" / "engine").mkdir(parents=True)
    (fake / "pipeline" / "engine" / "step.py").write_text("from pipeline.builder import build\n")
    (fake / "stages").mkdir()
    (fake / "stages" / "x.py").write_text("from backends.torch import _private\n")
    for package in ("backends", "transports"):
        (fake / package).mkdir()
    monkeypatch.setattr(__import__(__name__, fromlist=["SRC"]), "SRC", fake)
    with pytest.raises(AssertionError):
        test_no_import_points_the_wrong_way(*RULES[2])
    with pytest.raises(AssertionError):
        test_no_module_reaches_into_another_packages_private_parts()
