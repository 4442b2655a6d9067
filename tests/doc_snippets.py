"""Runs the Python snippets of a Markdown page, in order, the way a reader would.

A page's ```` ```python ```` blocks run one after another in one namespace (a tutorial's later
blocks use what earlier ones built). A block followed directly by a ```` ```text ```` block
must print exactly that text. A block right after a ``<!-- not run: REASON -->`` line is
shown to the reader but not run (what needs a GPU, say). Used by ``tests/test_docs.py``; run it by hand to see what each
block prints::

    python tests/doc_snippets.py docs/quickstart.md

It runs in the folder it is started in: relative paths in the snippets (``models/...``) are
resolved there, so the test lays out stand-ins for a reader's model files first.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
import time
from pathlib import Path

import attrs

FENCE = re.compile(r"^```(\w*)\s*$")
NOT_RUN = re.compile(r"^<!-- not run: (\S.*) -->$")


@attrs.frozen
class Snippet:
    """A Python block, its first line in the page, and the output it must print (if given)."""

    code: str
    line: int
    output: str | None


@attrs.frozen
class _Block:
    language: str
    line: int
    body: str
    follows_directly: bool  # only blank lines between this block and the one before
    not_run: str | None  # the reason given on a ``<!-- not run: ... -->`` line just before


def _blocks(page: Path) -> list[_Block]:
    blocks: list[_Block] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    prose = True  # any text since the last block
    reason: str | None = None  # a not-run line since the last block
    i = 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if opened is None:
            prose = prose or bool(lines[i].strip())
            marked = NOT_RUN.match(lines[i].strip())
            reason = marked.group(1) if marked else (reason if not lines[i].strip() else None)
            i += 1
            continue
        start, body = i + 1, []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        blocks.append(_Block(opened.group(1), start + 1, "\n".join(body) + "\n", not prose,
                             reason))
        prose, reason = False, None
        i += 1
    return blocks


def snippets(page: Path) -> list[Snippet]:
    """The page's Python blocks that run, each with the text block right after it, if any."""
    blocks = _blocks(page)
    out = []
    for k, block in enumerate(blocks):
        if block.language != "python" or block.not_run is not None:
            continue
        after = blocks[k + 1] if k + 1 < len(blocks) else None
        output = (after.body if after is not None and after.language == "text"
                  and after.follows_directly else None)
        out.append(Snippet(block.body, block.line, output))
    return out


def not_run(page: Path) -> list[tuple[int, str]]:
    """The page's Python blocks marked not to run: (line, reason)."""
    return [(b.line, b.not_run) for b in _blocks(page)
            if b.language == "python" and b.not_run is not None]


def run(page: Path) -> list[dict[str, object]]:
    """Run the page's snippets in order; each result has the line, what it printed, its
    error (None when it ran) and its seconds. Stops at the first error."""
    namespace: dict[str, object] = {"__name__": "__main__"}
    results: list[dict[str, object]] = []
    for snippet in snippets(page):
        printed = io.StringIO()
        start = time.perf_counter()
        error = None
        try:
            with contextlib.redirect_stdout(printed):
                exec(compile(snippet.code, f"{page.name}:{snippet.line}", "exec"), namespace)
        except BaseException as exc:  # report, then stop: later blocks depend on this one
            error = f"{type(exc).__name__}: {exc}"
        results.append({"line": snippet.line, "printed": printed.getvalue(), "error": error,
                        "expected": snippet.output, "seconds": time.perf_counter() - start})
        if error is not None:
            break
    return results


def main() -> int:
    """Print each block's result as JSON (one object per line)."""
    for result in run(Path(sys.argv[1]).resolve()):
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
