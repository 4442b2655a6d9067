"""Build the API reference: HTML pages generated from the docstrings with pdoc.

Owns :data:`MODULES`, the public face the reference covers (the ``pipeline`` package and its
public modules, and the stage, backend and transport packages users import to compose or
extend a pipeline), and :func:`build`, which ``make docs`` and ``tests/test_api_docs.py``
both call. The build is offline: pdoc imports the modules and renders their docstrings; it
fetches nothing.

Two adjustments to what pdoc does on its own:

- The docstrings are written in reStructuredText (``code``, :class:`Name`, ``Example::``).
  pdoc converts most of that to Markdown; :func:`_rst` adds the two things it leaves as they
  are: the ``~`` of a shortened cross-reference (``:class:`~pipeline.errors.SlotError```
  becomes a link to ``pipeline.errors.SlotError``) and a paragraph ending in ``::`` that
  introduces a literal block (it ends in one ``:``; the block below is code either way).
- A constant a package re-exports (``stages.process.DEFAULT_ORDER``, ``pipeline.hookimpl``)
  has its docstring where it is assigned, which pdoc reads only for the module being
  documented; :func:`_lend_docstrings` gives the package's entry that docstring.

Run: ``python scripts/api_docs.py [OUTPUT]`` (default ``build/api``), or ``make docs``.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import inspect
import re
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pdoc.doc
import pdoc.docstrings
import pdoc.extract
import pdoc.render

MODULES = (
    "pipeline", "pipeline.contracts", "pipeline.errors", "pipeline.events",
    "pipeline.registry", "pipeline.hookspecs", "pipeline.model_paths", "pipeline.testing",
    "pipeline.trace",
    "stages.render", "stages.tokenize", "stages.process", "stages.select", "stages.strategies",
    "stages.detokenize",
    "stages.stop", "backends.torch", "transports", "transports.http",
)
"""Modules the reference covers; a package with ``__all__`` shows exactly those names."""

DEFAULT_OUTPUT = Path("build/api")

_SHORTENED_ROLE = re.compile(r"(:(?:py:)?[a-z]+:`)~")
_LITERAL_INTRO = re.compile(r"(?m)(\S)::[ \t]*$")


def _rst(original: object) -> object:
    """pdoc's reST conversion, with the two additions the module docstring describes."""

    def convert(contents: str, source_file: Path | None) -> str:
        contents = _SHORTENED_ROLE.sub(r"\1", contents)
        contents = _LITERAL_INTRO.sub(r"\1:", contents)
        return original(contents, source_file)  # type: ignore[operator, no-any-return]

    return convert


@contextlib.contextmanager
def _our_rst() -> Iterator[None]:
    """Use :func:`_rst` for this build only (pdoc caches converted docstrings: cleared)."""
    original = pdoc.docstrings.rst
    pdoc.docstrings.rst = _rst(original)  # type: ignore[assignment]
    pdoc.docstrings.convert.cache_clear()
    try:
        yield
    finally:
        pdoc.docstrings.rst = original
        pdoc.docstrings.convert.cache_clear()


def module_names() -> list[str]:
    """Every module the reference renders: :data:`MODULES` and the submodules pdoc walks
    into (a package's ``__all__`` decides which)."""
    return list(pdoc.extract.walk_specs(list(MODULES)))


def _origins(module: object) -> dict[str, str]:
    """For each name a ``from MODULE import name`` at the top of ``module``'s source (or in
    its ``if TYPE_CHECKING:`` block, as :mod:`pipeline`'s table) brings in, the module it comes
    from."""
    found: dict[str, str] = {}
    body = ast.parse(inspect.getsource(module)).body  # type: ignore[arg-type]
    nodes = [*body, *(n for node in body if isinstance(node, ast.If) for n in node.body)]
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                found[alias.asname or alias.name] = node.module
    return found


def _lend_docstrings(module: pdoc.doc.Module) -> None:
    """Give each re-exported constant without a docstring here the one it has where it is
    assigned."""
    origins = _origins(module.obj)
    for name, member in module.members.items():
        if not isinstance(member, pdoc.doc.Variable) or member.docstring or name not in origins:
            continue
        source = pdoc.doc.Module.from_name(origins[name]).get(name)
        if source is not None and source.docstring:
            member.docstring = source.docstring


def build(output: Path = DEFAULT_OUTPUT) -> list[str]:
    """Write the reference's HTML into ``output``; return pdoc's warnings (an annotation it
    could not evaluate, a docstring it could not convert), which do not stop the build.

    The steps are ``pdoc.pdoc``'s (a page per module, the index, the search index) with
    :func:`_lend_docstrings` between loading the modules and rendering them.
    """
    from pipeline import __version__

    pdoc.render.configure(docformat="restructuredtext", show_source=False,
                          footer_text=f"explicit-pipeline {__version__}")
    with warnings.catch_warnings(record=True) as caught, _our_rst():
        warnings.simplefilter("always")
        modules = {name: pdoc.doc.Module.from_name(name) for name in module_names()}
        for module in modules.values():
            _lend_docstrings(module)
        for name, module in modules.items():
            page = output / (name.replace(".", "/") + ".html")
            page.parent.mkdir(parents=True, exist_ok=True)
            page.write_text(pdoc.render.html_module(module, modules), encoding="utf-8")
        (output / "index.html").write_text(pdoc.render.html_index(modules), encoding="utf-8")
        (output / "search.js").write_text(pdoc.render.search_index(modules), encoding="utf-8")
    return [str(w.message) for w in caught]


def main(argv: list[str] | None = None) -> int:
    """Build the reference into the folder given (default ``build/api``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", nargs="?", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    for warning in build(args.output):
        print(f"warning: {warning}", file=sys.stderr)
    print(f"API reference: {args.output / 'index.html'} "
          f"({len(module_names())} modules, {time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
