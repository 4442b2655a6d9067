"""The ``pipeline`` command as a user meets it: ``run`` (prompt or stdin, sampling flags,
``--json``, ``--trace``), ``count`` (chat template or ``--raw``), ``--version``,
``python -m pipeline``, and errors as one line without a traceback, also under ``| head``.

Oracles: the library's own ``generate`` and ``count_tokens`` on the same model (the CLI adds
no behaviour of its own), and the trace tooling reading the file ``--trace`` wrote."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pipeline import build
from transports import cli
from pipeline.trace import check, load_all

RUN = [sys.executable, "-m", "pipeline"]


def test_run_streams_what_generate_returns(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", "--model", "tiny", "Why?", "--temperature", "0",
                     "--max-tokens", "12", "--system", "Be brief."]) == 0
    out = capsys.readouterr().out
    with build("tiny") as pipe:
        want = pipe.generate([{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": "Why?"}],
                             temperature=0, max_tokens=12).text
    assert out == want + "\n"


def test_run_json_and_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                            monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("2+2?"))
    trace = tmp_path / "run.jsonl"
    assert cli.main(["run", "--model", "tiny", "--json", "--seed", "5", "--top-k", "20",
                     "--top-p", "0.9", "--min-p", "0.01", "--repetition-penalty", "1.1",
                     "--stop", "zzz", "--max-tokens", "6", "--trace", str(trace)]) == 0
    result = json.loads(capsys.readouterr().out)
    with build("tiny") as pipe:
        want = pipe.generate("2+2?", seed=5, top_k=20, top_p=0.9, min_p=0.01,
                             repetition_penalty=1.1, stop=["zzz"], max_tokens=6)
    assert result["text"] == want.text and result["finish_reason"] == want.finish_reason.value
    assert result["usage"]["completion_tokens"] == want.usage.completion_tokens
    (loaded,) = load_all(trace)
    assert loaded.events[0].trace_id == result["request_id"]
    assert check(loaded).ok


def test_count_with_and_without_the_template(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["count", "--model", "tiny", "hello world"]) == 0
    assert cli.main(["count", "--model", "tiny", "--raw", "hello world"]) == 0
    templated, raw = (int(x) for x in capsys.readouterr().out.split())
    with build("tiny") as pipe:
        assert templated == pipe.count_tokens("hello world")
        assert pipe.stages.tokenizer is not None
        assert raw == len(pipe.stages.tokenizer.encode_text("hello world")) < templated


@pytest.mark.parametrize("argv, says", [
    (["run", "--model", "/no/such/model", "hi"], "no such folder or file"),
    (["run", "--model", "tiny", ""], "prompt"),
    (["run", "--model", "tiny", "hi", "--temperature", "-1"], "temperature"),
])
def test_errors_are_one_line_without_a_traceback(argv: list[str], says: str) -> None:
    done = subprocess.run(RUN + argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr and says in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_version_and_module_entry_point() -> None:
    from pipeline import __version__

    done = subprocess.run(RUN + ["--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == f"pipeline {__version__}"


def test_a_reader_that_leaves_early_ends_the_run_quietly() -> None:
    run = subprocess.Popen(RUN + ["run", "--model", "tiny", "tell me", "--max-tokens", "400",
                                  "--temperature", "0"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
    assert run.stdout is not None and run.stderr is not None
    run.stdout.read(5)
    run.stdout.close()  # what `| head -c 5` does
    err = run.stderr.read().decode()
    assert run.wait(timeout=120) == 0 and "Traceback" not in err
    assert [line.split()[0] for line in err.splitlines()] == ["loading", "ready"]  # no more


def _env_without_keys() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PIPELINE_API_KEYS"}


def test_serve_without_keys_refuses_a_public_address_and_warns_on_loopback() -> None:
    refused = subprocess.run(RUN + ["serve", "--model", "tiny", "--host", "0.0.0.0",
                                    "--port", "0"], capture_output=True, text=True,
                             timeout=60, env=_env_without_keys())
    assert refused.returncode == 2 and "--insecure" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    server = subprocess.Popen(RUN + ["serve", "--model", "tiny", "--host", "127.0.0.1",
                                     "--port", "0"], stderr=subprocess.PIPE, text=True,
                              env=_env_without_keys())
    try:
        assert server.stderr is not None
        first = server.stderr.readline()
        assert " WARNING pipeline.serve: no API keys are configured" in first
    finally:
        server.terminate()  # this test's own child, by its handle
        server.wait(timeout=30)


def test_every_option_of_every_command_has_help_text() -> None:
    """argparse prints no description for an option without ``help``: each one has some."""
    import argparse

    parsers: list[argparse.ArgumentParser] = []
    real = argparse.ArgumentParser.parse_args

    def capture(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        parsers.append(self)
        raise SystemExit(0)

    argparse.ArgumentParser.parse_args = capture  # type: ignore[method-assign,assignment]
    try:
        with pytest.raises(SystemExit):
            cli.main(["--version"])
    finally:
        argparse.ArgumentParser.parse_args = real  # type: ignore[method-assign]
    missing: list[str] = []

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, child in action.choices.items():
                    walk(child, f"{name} {sub}")
            elif not action.help:
                missing.append(f"{name} {action.option_strings or action.dest}")

    walk(parsers[0], "pipeline")
    assert missing == []


def test_run_with_a_json_schema_answers_valid_json(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    import jsonschema

    schema = {"type": "object", "additionalProperties": False, "required": ["ok", "n"],
              "properties": {"ok": {"type": "boolean"},
                             "n": {"type": "integer", "minimum": 0, "maximum": 9}}}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    for given in (json.dumps(schema), str(path)):
        assert cli.main(["run", "--model", "tiny", "Answer.", "--json-schema", given,
                         "--seed", "3", "--max-tokens", "40"]) == 0
        jsonschema.validate(json.loads(capsys.readouterr().out), schema)
    done = subprocess.run(RUN + ["run", "--model", "tiny", "x", "--json-schema",
                                 str(tmp_path / "missing.json")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "--json-schema" in done.stderr
    assert "Traceback" not in done.stderr
