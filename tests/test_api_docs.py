"""The API reference (``make docs``) builds offline and is complete.

Built with ``scripts/api_docs.py`` into a tmp folder while sockets refuse to connect. Checked
on the HTML it wrote: every name in ``pipeline.__all__`` (and in the ``__all__`` of every
other package the reference covers) has an entry with a docstring; and on the modules pdoc
walked: no public class, function or method of ours lacks a docstring.
"""

from __future__ import annotations

import importlib
import inspect
import runpy
import socket
import time
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pdoc.doc  # the dev extra installs pdoc
import pytest

ROOT = Path(__file__).resolve().parent.parent
OURS = ("pipeline", "stages", "backends", "transports")
API = runpy.run_path(str(ROOT / "scripts" / "api_docs.py"))
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
        "track", "wbr"}  # HTML elements without an end tag


class _Entries(HTMLParser):
    """The top-level entries of a pdoc page: ``<section id=NAME>``, and whether a
    ``docstring`` block inside it holds any text."""

    def __init__(self) -> None:
        super().__init__()
        self.entries: dict[str, str] = {}
        self._section: str | None = None
        self._depth = 0
        self._doc_depth: int | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "section" and found.get("id") and self._section is None:
            self._section, self._depth = str(found["id"]), 0
            self.entries[self._section] = ""
        if self._section is None or tag in VOID:
            return
        self._depth += 1
        if tag == "div" and "docstring" in (found.get("class") or "").split():
            self._doc_depth = self._depth

    def handle_endtag(self, tag: str) -> None:
        if self._section is None or tag in VOID:
            return
        if self._doc_depth == self._depth:
            self._doc_depth = None
        self._depth -= 1
        if tag == "section" and self._depth <= 0:
            self._section = None

    def handle_data(self, data: str) -> None:
        if self._section is not None and self._doc_depth is not None:
            self.entries[self._section] += data


def _entries(page: Path) -> dict[str, str]:
    parser = _Entries()
    parser.feed(page.read_text(encoding="utf-8"))
    return parser.entries


def _page(out: Path, module: str) -> Path:
    return out / (module.replace(".", "/") + ".html")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str], float]:
    out = tmp_path_factory.mktemp("api")
    with pytest.MonkeyPatch.context() as patch:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise OSError("the API reference build must not use the network")

        patch.setattr(socket.socket, "connect", refuse)
        patch.setattr(socket, "getaddrinfo", refuse)
        start = time.process_time()  # the work done, not the machine's load
        warnings = API["build"](out)
        elapsed = time.process_time() - start
    return out, warnings, elapsed


def test_the_reference_builds_offline_without_warnings(
        reference: tuple[Path, list[str], float]) -> None:
    out, warnings, elapsed = reference
    assert warnings == []
    assert (out / "index.html").is_file() and (out / "search.js").is_file()
    for module in API["module_names"]():
        assert _page(out, module).is_file(), module
    assert elapsed < 60, f"the reference took {elapsed:.1f} s (about 4 s on a 2-core machine)"


def test_every_exported_name_has_a_documented_entry(
        reference: tuple[Path, list[str], float]) -> None:
    out, _, _ = reference
    missing = []
    for module in API["MODULES"]:
        names = getattr(importlib.import_module(module), "__all__", None)
        if names is None:
            continue
        entries = _entries(_page(out, module))
        missing += [f"{module}.{name}" for name in names if not entries.get(name, "").strip()]
    assert missing == [], "exported names without a documented entry: " + ", ".join(missing)


def _has_docstring(obj: object) -> bool:
    """A docstring of its own, or (a class) one inherited from a class of ours; not one that
    ``object``, ``Exception`` or ``Enum`` lend."""
    if isinstance(obj, type):
        return any((base.__dict__.get("__doc__") or "").strip() for base in obj.__mro__
                   if base.__module__.split(".")[0] in OURS)
    return bool((inspect.getdoc(obj) or "").strip())


def _undocumented(namespace: pdoc.doc.Namespace[Any]) -> list[str]:
    out = []
    for name, member in namespace.members.items():
        if name.startswith("_") or member.modulename.split(".")[0] not in OURS:
            continue
        if isinstance(member, pdoc.doc.Class):
            if not _has_docstring(member.obj):
                out.append(member.fullname)
            out += _undocumented(member)
        elif isinstance(member, pdoc.doc.Function) and not _has_docstring(member.obj):
            out.append(member.fullname)
    return out


def test_no_public_class_or_function_lacks_a_docstring() -> None:
    missing = []
    for name in API["module_names"]():
        module = importlib.import_module(name)
        if not (module.__doc__ or "").strip():
            missing.append(name)
        missing += _undocumented(pdoc.doc.Module(module))
    assert missing == [], "public names without a docstring: " + ", ".join(sorted(set(missing)))


def test_the_reference_covers_the_public_face() -> None:
    import pipeline

    covered = set(API["module_names"]())
    assert {"pipeline", "pipeline.contracts", "pipeline.errors", "pipeline.testing",
            "pipeline.trace"} <= covered
    assert "transports.cli" not in covered  # internals stay out
    assert {"build", "Pipeline", "GenerationConfig", "hookimpl"} <= set(pipeline.__all__)
