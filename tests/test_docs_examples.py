"""The documentation's Python examples run as written, so the docs cannot rot.

Every fenced ``python`` block of docs/testing.md is executed on its own (a fresh namespace
per block), and every ``test_*`` function a block defines is called (``tests/test_docs.py``
runs every page's blocks in order, the README's included, but calls no test a block defines).
A block that names a placeholder (a model folder the reader is meant to replace) cannot run
here; such blocks are skipped only when their placeholder is listed in :data:`PLACEHOLDERS`,
and each listed placeholder must still appear, so the list stays exact.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("docs/testing.md",)
PLACEHOLDERS: dict[str, tuple[str, ...]] = {}
"""Per file, the placeholder strings whose blocks are skipped."""
FENCE = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def blocks(name: str) -> list[tuple[int, str]]:
    """``(line, source)`` of each python block of ``name``."""
    text = (ROOT / name).read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in FENCE.finditer(text)]


CASES = [pytest.param(name, line, source, id=f"{name}:{line}")
         for name in DOCS for line, source in blocks(name)]


def test_every_listed_placeholder_is_still_in_its_file() -> None:
    for name, placeholders in PLACEHOLDERS.items():
        sources = [source for _, source in blocks(name)]
        for placeholder in placeholders:
            assert any(placeholder in s for s in sources), f"{name}: {placeholder} is gone"
    assert sum(1 for case in CASES if case.values[0] == "docs/testing.md") >= 3


@pytest.mark.parametrize("name, line, source", CASES)
def test_the_example_runs(name: str, line: int, source: str) -> None:
    skipped = [p for p in PLACEHOLDERS.get(name, ()) if p in source]
    if skipped:
        pytest.skip(f"names the placeholder {skipped[0]!r}")
    namespace: dict[str, object] = {"__name__": f"docs_example_{line}"}
    exec(compile(source, f"{name}:{line}", "exec"), namespace)  # the example, as written
    tests = [v for k, v in namespace.items() if k.startswith("test_") and callable(v)]
    for test in tests:
        test()
