"""A package's public names imported from their homes on first use (PEP 562).

Owns :func:`homes` (each name a package's ``if TYPE_CHECKING:`` block imports, and the module
it comes from: the one table a type checker and the run time both read) and :func:`lazy`
(the module-level ``__getattr__`` and ``__dir__`` that import a name on first use and keep it
in the package, so a documentation tool and later lookups find it there). ``pipeline`` and
``transports.http`` use them, so a command line that parses its arguments or counts tokens
never waits for torch or the server.

Example (a package's ``__init__.py``)::

    if TYPE_CHECKING:
        from pkg.heavy import Thing as Thing
    _HOMES = homes(__file__)                       # {"Thing": "pkg.heavy"}
    __getattr__, __dir__ = lazy(__name__, _HOMES, globals())
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any


def homes(init_file: str) -> dict[str, str]:
    """Each name the ``if TYPE_CHECKING:`` block of ``init_file`` imports, and its module."""
    tree = ast.parse(Path(init_file).read_text(encoding="utf-8"))
    block = next(node for node in tree.body if isinstance(node, ast.If)
                 and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
    return {alias.name: node.module for node in block.body
            if isinstance(node, ast.ImportFrom) and node.module for alias in node.names}


def lazy(package: str, table: Mapping[str, str], namespace: dict[str, Any]
         ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``, whose globals are ``namespace``: a
    name of ``table`` is imported from its module when first asked for and kept in
    ``namespace`` (later lookups do not come here); any other name is an AttributeError."""

    def getattr_(name: str) -> Any:
        home = table.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted({*namespace, *table})

    return getattr_, dir_
