"""The command line at its edges: each a one-line error that says what to do, or the
expected behaviour.

- ``--record full`` (``run`` and ``chat``): the trace ``--trace`` writes holds each token's
  text, so ``pipeline trace show`` lists it even without the model's tokenizer; a bad level is
  one line listing the levels.
- A misspelt option of any command: one line naming it and the closest option.
- ``serve --port`` outside 0-65535: one line naming ``--port`` before anything loads.
- ``count -`` (and ``count`` alone) counts standard input, as ``run -`` answers it.

Oracles: the run's own ``--json`` answer, the library's ``count_tokens``, argparse's own
option table, and the operating system's port range.
"""

from __future__ import annotations

import ast
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import build, cli

RUN = [sys.executable, "-m", "pipeline"]
SHOWN_TEXT = re.compile(r"token\.selected\s+step=(\d+) token_id=\d+ text=('(?:[^'\\]|\\.)*'|"
                        r"\"(?:[^\"\\]|\\.)*\")")


def _main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _shown_texts(capsys: pytest.CaptureFixture[str], trace: Path) -> list[str]:
    """The token texts ``pipeline trace show`` lists, told a model with another tokenizer (so
    only the trace itself can give them)."""
    code, out, _ = _main(capsys, "trace", "show", "--model", "tiny-masked", str(trace))
    assert code == 0
    return [ast.literal_eval(text) for _, text in SHOWN_TEXT.findall(out)]


def _streamed(trace: Path) -> list[str]:
    """The text the trace's ``stream.delta`` events hold (a ``full`` trace's content)."""
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    return [e["payload"]["text"] for e in events
            if e["event_type"] == "stream.delta" and "text" in e["payload"]]


# --- --record ------------------------------------------------------------------------------

def test_run_record_full_puts_the_token_text_in_the_trace(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    full, digest = tmp_path / "full.jsonl", tmp_path / "digest.jsonl"
    flags = ["run", "--model", "tiny", "--temperature", "0", "--max-tokens", "6",
             "--min-tokens", "6", "--json", "hi"]
    code, out, _ = _main(capsys, *flags[:-1], "--trace", str(full), "--record", "full", "hi")
    assert code == 0
    answer = json.loads(out)["text"]
    assert "".join(_streamed(full)) == answer  # the trace itself holds the text
    assert "".join(_shown_texts(capsys, full)) == answer
    code, _, _ = _main(capsys, *flags[:-1], "--trace", str(digest), "hi")
    assert code == 0  # the default level: digests, no text
    assert _streamed(digest) == [] and _shown_texts(capsys, digest) == []


def test_chat_record_full_puts_every_turns_token_text_in_the_trace(
        capsys: pytest.CaptureFixture[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    trace = tmp_path / "chat.jsonl"
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    code, out, _ = _main(capsys, "chat", "--model", "tiny", "--temperature", "0",
                         "--max-tokens", "5", "--min-tokens", "5", "--trace", str(trace),
                         "--record", "full")
    assert code == 0
    assert "".join(_shown_texts(capsys, trace)) == out.strip("\n")


@pytest.mark.parametrize("argv, says", [
    (["run", "--model", "tiny", "--trace", "t.jsonl", "--record", "fulll", "hi"],
     "pipeline run: --record='fulll': must be one of digest, full"),
    (["chat", "--model", "tiny", "--trace", "t.jsonl", "--record", "all"],
     "pipeline chat: --record='all': must be one of digest, full"),
    (["run", "--model", "tiny", "--record", "full", "hi"],
     "pipeline run: --record='full': sets the level of the trace --trace FILE writes"),
])
def test_a_bad_record_level_is_one_line_listing_the_levels(
        tmp_path: Path, argv: list[str], says: str) -> None:
    done = subprocess.run(RUN + argv, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert done.returncode == 1
    line, = done.stderr.strip().splitlines()
    assert line.startswith(says)
    assert not (tmp_path / "t.jsonl").exists()
