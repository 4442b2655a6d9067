"""The command line at its edges: each a one-line error that says what to do, or the
expected behaviour.

- ``--record full`` (``run`` and ``chat``): the trace ``--trace`` writes holds each token's
  text, so ``pipeline trace show`` lists it even without the model's tokenizer; a bad level is
  one line listing the levels.
- A misspelt option of any command: one line naming it and the closest option.
- ``serve --port`` outside 0-65535: one line naming ``--port`` before anything loads.
- ``count -`` (and ``count`` alone) counts standard input, as ``run -`` answers it.
- ``build("models/X")``: with ``models/`` here, no such folder; without it (a path or a repo
  id), no such folder here and not in the Hugging Face cache, both said.

Oracles: the run's own ``--json`` answer, the library's ``count_tokens``, argparse's own
option table, and the ports the operating system's socket layer takes.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pipeline import build
from transports import cli
from pipeline.errors import ArtifactError

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


# --- misspelt options ----------------------------------------------------------------------

def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser (``pipeline``, ``pipeline run``, ``pipeline trace show`` ...),
    as ``main`` builds them."""
    captured: list[argparse.ArgumentParser] = []
    real = argparse.ArgumentParser.parse_args

    def capture(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        captured.append(self)
        raise SystemExit(0)

    argparse.ArgumentParser.parse_args = capture  # type: ignore[method-assign,assignment]
    try:
        with pytest.raises(SystemExit):
            cli.main(["serve"])  # serve's parser with all its flags
    finally:
        argparse.ArgumentParser.parse_args = real  # type: ignore[method-assign]
    found: dict[str, argparse.ArgumentParser] = {}

    def walk(parser: argparse.ArgumentParser) -> None:
        found[parser.prog] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    walk(child)

    walk(captured[0])
    return found


PARSERS = _parsers()
COMMANDS = [prog for prog, parser in PARSERS.items()
            if prog != "pipeline" and not any(isinstance(a, argparse._SubParsersAction)
                                              for a in parser._actions)]


def _options(prog: str) -> list[str]:
    return [flag for action in PARSERS[prog]._actions for flag in action.option_strings
            if flag.startswith("--") and flag != "--help"]


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """The one line a usage error writes (exit status 2, nothing on standard output)."""
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    out, err = capsys.readouterr()
    assert stop.value.code == 2 and out == ""
    line, = err.strip("\n").split("\n")
    assert "Traceback" not in line
    return line


@pytest.mark.parametrize("argv, says", [
    (["run", "--temprature", "0.5", "hi"],
     "pipeline run: unknown option --temprature; did you mean --temperature?"),
    (["chat", "--sytem", "Be brief."],
     "pipeline chat: unknown option --sytem; did you mean --system?"),
    (["count", "--rwa", "x"], "pipeline count: unknown option --rwa; did you mean --raw?"),
    (["serve", "--prot", "80"], "pipeline serve: unknown option --prot; did you mean --port?"),
    (["trace", "show", "--limt", "3", "t.jsonl"],
     "pipeline trace show: unknown option --limt; did you mean --limit?"),
    (["--verison"], "pipeline: unknown option --verison; did you mean --version?"),
    (["run", "--temprature=0.5", "hi"],
     "pipeline run: unknown option --temprature; did you mean --temperature?"),
])
def test_a_misspelt_option_is_one_line_naming_the_closest(
        capsys: pytest.CaptureFixture[str], argv: list[str], says: str) -> None:
    assert _refused(capsys, argv) == says


@pytest.mark.parametrize("prog", COMMANDS)
def test_every_commands_options_misspelt_suggest_themselves(
        capsys: pytest.CaptureFixture[str], prog: str) -> None:
    """Every long option of every command, two of its letters swapped, is refused with that
    very option suggested (the oracle: argparse's own table of the command's options)."""
    needed = [a.dest for a in PARSERS[prog]._actions  # its required arguments, given
              if not a.option_strings and a.nargs is None]
    words, options = [*prog.split()[1:], *needed], _options(prog)
    for option in options:
        name = option[2:]
        i = next((i for i in range(1, len(name) - 1) if name[i] != name[i + 1]), None)
        if len(name) < 4 or i is None:
            continue
        typo = f"--{name[:i]}{name[i + 1]}{name[i]}{name[i + 2:]}"
        assert not any(o.startswith(typo) for o in options)  # no abbreviation argparse takes
        line = _refused(capsys, [*words, typo])
        assert line == f"{prog}: unknown option {typo}; did you mean {option}?", line


# --- serve --port --------------------------------------------------------------------------

def _a_port(value: int) -> bool:
    """Whether the operating system's socket layer takes ``value`` as a TCP port."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", value))
        except OverflowError:  # "port must be 0-65535"
            return False
        except OSError:  # in use, or privileged: a port still
            pass
    return True


@pytest.mark.parametrize("value", ["99999", "65536", "-5", "-1", "80.5", "http"])
def test_serve_refuses_a_port_out_of_range_in_one_line_naming_the_flag(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    import transports.http

    assert not (value.lstrip("-").isdigit() and _a_port(int(value)))
    monkeypatch.setattr(transports.http, "serve", lambda *args: None)  # taken: no serving
    line = _refused(capsys, ["serve", "--model", "tiny", "--port", value])
    assert line.startswith(f"pipeline serve: argument --port: {value!r} is not a TCP port: "
                           "give 0 to 65535")


@pytest.mark.parametrize("value", [0, 1, 8000, 65535])
def test_serve_takes_every_port_the_system_takes(monkeypatch: pytest.MonkeyPatch,
                                                 value: int) -> None:
    import transports.http
    from transports.http.accounting import logs

    assert _a_port(value)
    asked: list[int] = []
    monkeypatch.setattr(transports.http, "serve", lambda config, host, port: asked.append(port))
    monkeypatch.setattr(logs, "configure", lambda level: None)
    assert cli.main(["serve", "--model", "tiny", "--port", str(value)]) == 0
    assert asked == [value]


def test_serve_on_port_0_listens_on_a_free_port_and_says_which(tmp_path: Path) -> None:
    server = subprocess.Popen(RUN + ["serve", "--model", "tiny", "--port", "0", "--data-dir",
                                     str(tmp_path)], stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PIPELINE_API_KEYS": "k"})
    try:
        assert server.stderr is not None
        for line in server.stderr:
            found = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            if found:
                break
        else:
            raise AssertionError("the server never said where it listens")
        port = int(found.group(1))
        assert 0 < port < 65536
        with socket.create_connection(("127.0.0.1", port), timeout=30):
            pass
    finally:
        server.terminate()  # this test's own child, by its handle
        server.wait(timeout=30)


# --- count - -------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [["-"], []])
@pytest.mark.parametrize("raw", [False, True])
def test_count_dash_or_nothing_counts_standard_input(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        argv: list[str], raw: bool) -> None:
    text = "How many tokens is this?\nTwo lines.\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    code, out, _ = _main(capsys, "count", "--model", "tiny", *(["--raw"] if raw else []),
                         *argv)
    assert code == 0
    with build("tiny") as pipe:
        assert pipe.stages.tokenizer is not None
        want = (len(pipe.stages.tokenizer.encode_text(text)) if raw
                else pipe.count_tokens(text))
    assert int(out) == want


# --- a model path that is not there ----------------------------------------------------------

def test_a_missing_entry_of_a_folder_here_is_no_such_folder_not_a_cache_miss(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    (tmp_path / "models").mkdir()
    assert not (tmp_path / "models" / "X").exists()
    with pytest.raises(ArtifactError) as err:
        build("models/X")
    assert str(err.value) == f"model 'models/X': no such folder or file ({tmp_path}/models/X)"


def test_a_name_that_is_in_neither_place_says_both_the_folder_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert not (tmp_path / "models").exists()  # a path, or a repo id: it can be either
    with pytest.raises(ArtifactError) as err:
        build("models/X")
    said = str(err.value)
    assert said.startswith(f"model 'models/X': no such folder or file here "
                           f"({tmp_path}/models/X), and not in the local Hugging Face cache")
    assert str(tmp_path / "hub" / "models--models--X") in said
    assert cli.main(["run", "--model", "models/X", "hi"]) == 1
    assert capsys.readouterr().err == f"pipeline run: {said}\n"


def test_the_top_level_help_is_written_for_a_new_user(capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    """``pipeline --help`` says what the tool does and shows examples, not the maintainers'
    notes (no reStructuredText markup, no "Owns"); every example is a command line the
    parser itself accepts."""
    import shlex

    with pytest.raises(SystemExit) as done:
        cli.main(["--help"])
    assert done.value.code == 0
    shown = capsys.readouterr().out
    assert "``" not in shown and ":class:" not in shown and "Owns" not in shown
    assert "SmolLM2-135M-Instruct" in shown and "http://127.0.0.1:8000/" in shown
    examples = [line.strip().split("  ")[0] for line in shown.splitlines()
                if line.startswith("  pipeline ")]
    assert len(examples) >= 5
    commands_shown = [shlex.split(c) for e in examples for c in e.split(";")]
    for words in commands_shown:                 # as main's own parsers read them
        parser = PARSERS[" ".join(words[:3] if words[1] == "trace" else words[:2])]
        parser.parse_args(words[3 if words[1] == "trace" else 2:])   # exit 2 on a usage error
    assert {w[1] for w in commands_shown} >= {"run", "chat", "serve", "count", "trace"}
