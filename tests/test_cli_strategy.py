"""The strategy flags of ``pipeline run``, ``chat`` and ``serve`` (issue 14, "the same face"):
``--strategy``, ``--steps``, ``--block-length`` and ``--strategy-option KEY=VALUE``.

Oracles: the model's own ``config.json`` marker (the default strategy and its settings), the
library's ``build(...).generate`` with the same settings (the command line adds no behaviour
of its own), the ``step.configured`` event of the trace the command wrote, the official
``openai`` SDK against the real ``pipeline serve`` in a subprocess, and the JSON the server
lists its models with when it serves an autoregressive model beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from pipeline import build
from transports import cli
from transports.cli.strategy import add_strategy, served_choices, strategy_choice
from pipeline.errors import InvalidValueError
from pipeline.model_paths import TINY_MASKED_MODEL_DIR
from pipeline.strategy_choice import StrategyChoice
from pipeline.trace import check, load_all
from tests.test_cli_serve_logs import LINE, LISTEN, Log

RUN = [sys.executable, "-m", "pipeline"]
KEY = "sk-test-strategy"
QUESTION = "What is a Python list?"
MESSAGES = [{"role": "user", "content": QUESTION}]
BUILT_IN = ("autoregressive", "speculative", "llada", "fast_dllm", "dfm", "ddpm", "ddim", "flow")


def marker(folder: Path) -> dict[str, Any]:
    """The model's ``pipeline_generation`` marker, read from its config.json."""
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    return dict(config["pipeline_generation"])


def configured(trace: Path) -> dict[str, Any]:
    """The ``step.configured`` payload of the one request in ``trace``; the trace must pass
    ``trace check``."""
    (loaded,) = load_all(trace)
    assert check(loaded).ok
    (event,) = [e for e in loaded.events if e.event_type == "step.configured"]
    return dict(event.payload)


def library(strategy: StrategyChoice, model: str = "tiny-masked", **params: Any) -> str:
    with build(model, **strategy.build_args()) as pipe:
        return pipe.generate(MESSAGES, **params).text


# --- pipeline run --------------------------------------------------------------------------


def test_run_takes_the_models_strategy_from_its_marker(tmp_path: Path) -> None:
    trace = tmp_path / "default.jsonl"
    done = subprocess.run(RUN + ["run", "--model", "tiny-masked", QUESTION, "--temperature",
                                 "0", "--max-tokens", "16", "--trace", str(trace)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == library(StrategyChoice(), temperature=0, max_tokens=16) + "\n"
    want = marker(TINY_MASKED_MODEL_DIR)
    got = configured(trace)
    assert got["sampler"] == want["strategy"]
    assert (got["steps"], got["block_length"]) == (want["steps"], want["block_length"])


@pytest.mark.parametrize("flags, choice, recorded", [
    (["--strategy", "fast_dllm", "--steps", "4", "--block-length", "8",
      "--strategy-option", "threshold=0.1"],
     StrategyChoice("fast_dllm", 4, 8, {"threshold": 0.1}),
     {"sampler": "fast_dllm", "steps": 4, "block_length": 8, "threshold": 0.1}),
    (["--strategy", "llada", "--steps", "4", "--block-length", "8", "--strategy-option",
      "remasking=random"],
     StrategyChoice("llada", 4, 8, {"remasking": "random"}),
     {"sampler": "llada", "steps": 4, "block_length": 8, "remasking": "random"}),
    (["--block-length", "4"], StrategyChoice(block_length=4),
     {"sampler": "llada", "steps": 4, "block_length": 4}),
])
def test_run_flags_change_the_output_and_reach_the_trace(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str],
        choice: StrategyChoice, recorded: dict[str, Any]) -> None:
    trace = tmp_path / "flags.jsonl"
    assert cli.main(["run", "--model", "tiny-masked", QUESTION, "--temperature", "0",
                     "--seed", "7", "--max-tokens", "16", "--trace", str(trace), *flags]) == 0
    out = capsys.readouterr().out
    assert out == library(choice, temperature=0, seed=7, max_tokens=16) + "\n"
    assert out != library(StrategyChoice(), temperature=0, seed=7, max_tokens=16) + "\n"
    got = configured(trace)
    assert {k: got[k] for k in recorded} == recorded


def test_run_a_flow_model_with_its_solver_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", "--model", "tiny-flow", QUESTION, "--seed", "3", "--max-tokens",
                     "16", "--steps", "5", "--strategy-option", "solver=heun", "--json"]) == 0
    text = json.loads(capsys.readouterr().out)["text"]
    heun = StrategyChoice(steps=5, options={"solver": "heun"})
    assert text == library(heun, "tiny-flow", seed=3, max_tokens=16)
    assert text != library(StrategyChoice(steps=5), "tiny-flow", seed=3, max_tokens=16)


# --- the value -----------------------------------------------------------------------------


def test_a_choice_is_what_build_takes_and_merges_key_by_key() -> None:
    base = StrategyChoice("fast_dllm", 4, 8, {"threshold": 0.9, "mask_token_id": 6144})
    assert base.build_args() == {"strategy": "fast_dllm", "steps": 4, "block_length": 8,
                                 "strategy_options": {"threshold": 0.9, "mask_token_id": 6144}}
    assert StrategyChoice().build_args()["strategy_options"] is None and StrategyChoice().empty
    assert StrategyChoice(steps=2, options={"threshold": 0.5}).over(base) == StrategyChoice(
        "fast_dllm", 2, 8, {"threshold": 0.5, "mask_token_id": 6144})
    assert base.settings() == "steps=4 block_length=8 mask_token_id=6144 threshold=0.9"
    assert StrategyChoice(options={"solver": "heun", "x": [1]}).settings() == 'solver=heun x=[1]'


@pytest.mark.parametrize("fields, says", [
    ({"steps": 0}, "steps=0: must be an integer >= 1"),
    ({"block_length": True}, "block_length=True: must be an integer >= 1"),
    ({"strategy": ""}, "strategy='': must be a strategy's name"),
    ({"options": {"steps": 3}}, "steps is a field of its own"),
    ({"options": [("a", 1)]}, "must be a mapping"),
])
def test_a_choice_refuses_what_it_can_tell_alone(fields: dict[str, Any], says: str) -> None:
    with pytest.raises(InvalidValueError, match=re.escape(says)):
        StrategyChoice(**fields)


def test_server_config_holds_a_choice_per_served_model(tmp_path: Path) -> None:
    from transports.http import Gateway, ServerConfig

    masked = StrategyChoice("fast_dllm", steps=4)
    config = ServerConfig(models={"m": Path("tiny-masked"), "t": Path("tiny")},
                          strategies={"m": masked}, data_dir=tmp_path)
    assert config.strategy("m") == masked and config.strategy("t").empty
    with pytest.raises(InvalidValueError, match="no served model has that name"):
        ServerConfig(models={"m": None}, strategies={"x": masked}, data_dir=tmp_path)
    with pytest.raises(InvalidValueError, match="must be a StrategyChoice"):
        ServerConfig(models={"m": None}, strategies={"m": {"steps": 4}}, data_dir=tmp_path)
    with pytest.raises(InvalidValueError, match="choose the strategy there"):
        Gateway(config, lambda folder, cfg: build(folder))


# --- reading the flags ---------------------------------------------------------------------


def _parsed(argv: list[str], per_model: bool = False) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_strategy(parser, per_model=per_model)
    return parser.parse_args(argv)


def test_option_values_are_json_when_they_parse_else_strings() -> None:
    args = _parsed(["--strategy-option", "threshold=0.5", "--strategy-option", "a=true",
                    "--strategy-option", "b=heun", "--strategy-option", 'c="7"',
                    "--strategy-option", "d=[1, 2]", "--strategy-option", "e=", "--strategy-option",
                    "f=x=y", "--steps", "3"])
    assert strategy_choice(args) == StrategyChoice(steps=3, options={
        "threshold": 0.5, "a": True, "b": "heun", "c": "7", "d": [1, 2], "e": "", "f": "x=y"})


def test_serve_settings_apply_to_every_model_unless_named() -> None:
    args = _parsed(["--steps", "4", "--strategy", "m:fast_dllm", "--steps", "m:2",
                    "--strategy-option", "m:threshold=0.3", "--strategy-option", "solver=heun",
                    "--block-length", "x:y:8"], per_model=True)
    assert served_choices(args, ["m", "f", "x:y"]) == {
        "m": StrategyChoice("fast_dllm", 2, None, {"threshold": 0.3, "solver": "heun"}),
        "f": StrategyChoice(None, 4, None, {"solver": "heun"}),
        "x:y": StrategyChoice(None, 4, 8, {"solver": "heun"})}
    assert served_choices(_parsed([], per_model=True), ["m"]) == {}


@pytest.mark.parametrize("argv, says", [
    (["--steps", "q:4"], "--steps='q:4': no served model is named 'q' (served: m, f)"),
    (["--strategy-option", "q:a=1"], "--strategy-option='q:a=1': no served model is named 'q'"),
    (["--steps", "m:4", "--steps", "m:5"], "--steps=5: given twice (first 4)"),
    (["--strategy-option", "a=1", "--strategy-option", "a=2"], "a is given twice"),
    (["--block-length", "m:0"], "--block-length=0: must be an integer >= 1"),
])
def test_serve_settings_refused(argv: list[str], says: str) -> None:
    with pytest.raises(InvalidValueError) as raised:
        served_choices(_parsed(argv, per_model=True), ["m", "f"])
    assert says in str(raised.value)


# --- errors: one line naming the flag -------------------------------------------------------


@pytest.mark.parametrize("argv, says", [
    (["--strategy", "fast_dlm"], ["--strategy='fast_dlm': no such strategy (did you mean "
                                  "'fast_dllm'?); the known ones: ", *BUILT_IN]),
    (["--strategy", "fast_dllm", "--strategy-option", "treshold=0.9"],
     ["--strategy-option='treshold': 'fast_dllm' has no option 'treshold' (did you mean "
      "'threshold'?); its options: ", "threshold"]),
    (["--strategy-option", "remasking=sometimes"],
     ["--strategy-option remasking='sometimes'", "low_confidence", "random"]),
    (["--strategy-option", "slover=heun"], ["--strategy-option='slover': 'flow' has no "
                                            "option 'slover' (did you mean 'solver'?)"]),
    (["--strategy-option", "threshold=0.5"], ["--strategy-option='threshold': 'llada' has no "
                                              "option 'threshold'; its options: "]),
    (["--steps", "0"], ["--steps=0: must be an integer >= 1"]),
    (["--steps", "four"], ["--steps='four': must be an integer >= 1"]),
    (["--steps", "20"], ["--steps=20: must be in 1..block_length (8)"]),
    (["--block-length", "-2"], ["--block-length=-2: must be an integer >= 1"]),
    (["--strategy-option", "threshold"], ["--strategy-option='threshold': write KEY=VALUE"]),
    (["--strategy-option", "steps=4"], ["--strategy-option='steps=4': use --steps for steps"]),
    (["--strategy", "autoregressive"], ["--strategy='autoregressive': needs an autoregressive "
                                        "model", "use --strategy llada)"]),
    (["--strategy", "ddim"], ["--strategy='ddim': needs a model trained for it"]),
])
def test_bad_strategy_flags_are_one_line_naming_the_flag(
        capsys: pytest.CaptureFixture[str], argv: list[str], says: list[str]) -> None:
    model = "tiny-flow" if "slover=heun" in argv else "tiny-masked"
    assert cli.main(["run", "--model", model, "hi", "--max-tokens", "2", *argv]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    line, = captured.err.strip().splitlines()
    assert line.startswith("pipeline run: ")
    for part in says:
        assert part in line


def test_an_autoregressive_models_strategy_and_its_options(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", "--model", "tiny", QUESTION, "--temperature", "0", "--max-tokens",
                     "12", "--strategy", "speculative", "--strategy-option",
                     "num_draft_tokens=3"]) == 0
    speculative = StrategyChoice("speculative", options={"num_draft_tokens": 3})
    assert capsys.readouterr().out == library(speculative, "tiny", temperature=0,
                                              max_tokens=12) + "\n"
    assert cli.main(["run", "--model", "tiny", "hi", "--strategy", "speculative",
                     "--strategy-option", "num_draft=3"]) == 1
    line, = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("pipeline run: --strategy-option='num_draft': 'speculative' has no "
                           "option 'num_draft' (did you mean 'num_draft_tokens'?)")


def test_iterative_settings_on_an_autoregressive_model(capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    assert cli.main(["run", "--model", "tiny", "hi", "--steps", "4", "--block-length",
                     "8"]) == 1
    line, = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("pipeline run: --steps, --block-length=[4, 8]: ")
    assert "configure iterative strategies" in line
    assert cli.main(["run", "--model", "tiny", "hi", "--strategy-option", "threshold=0.9"]) == 1
    line, = capsys.readouterr().err.strip().splitlines()
    assert line == ("pipeline run: --strategy-option={'threshold': 0.9}: the autoregressive "
                    "strategy takes no options (did you mean --strategy speculative?)")


def test_chat_takes_the_flags_and_refuses_bad_ones_before_reading(tmp_path: Path) -> None:
    trace = tmp_path / "chat.jsonl"
    done = subprocess.run(RUN + ["chat", "--model", "tiny-masked", "--strategy", "fast_dllm",
                                 "--steps", "4", "--strategy-option", "threshold=0.1",
                                 "--temperature", "0", "--max-tokens", "8", "--trace",
                                 str(trace)],
                          input=QUESTION + "\n", capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    choice = StrategyChoice("fast_dllm", 4, None, {"threshold": 0.1})
    assert done.stdout == library(choice, temperature=0, max_tokens=8) + "\n"
    got = configured(trace)
    assert (got["sampler"], got["steps"], got["threshold"]) == ("fast_dllm", 4, 0.1)
    bad = subprocess.run(RUN + ["chat", "--model", "tiny-masked", "--strategy", "nope"],
                         input="hi\n", capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and bad.stdout == ""
    line, = bad.stderr.strip().splitlines()
    assert line.startswith("pipeline chat: --strategy='nope': no such strategy")


# --- pipeline serve ------------------------------------------------------------------------


@contextmanager
def serving(data_dir: Path, *args: str) -> Iterator[tuple[str, Log]]:
    server = subprocess.Popen(RUN + ["serve", "--host", "127.0.0.1", "--port", "0",
                                     "--data-dir", str(data_dir), *args],
                              stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PIPELINE_API_KEYS": KEY})
    assert server.stderr is not None
    log = Log(server.stderr)
    try:
        yield log.wait_for(LISTEN.pattern).group(1), log
    finally:
        server.terminate()  # this test's own child, by its handle
        server.wait(timeout=60)


def test_serve_runs_each_model_with_its_flags(tmp_path: Path) -> None:
    openai = pytest.importorskip("openai")
    masked = StrategyChoice("fast_dllm", 4, 8, {"threshold": 0.1})
    flow = StrategyChoice(None, 6, None, {"solver": "heun"})
    with serving(tmp_path, "--model", "masked=tiny-masked", "--model", "flow=tiny-flow",
                 "--model", "tiny", "--strategy", "masked:fast_dllm", "--steps", "masked:4",
                 "--block-length", "masked:8", "--strategy-option", "masked:threshold=0.1",
                 "--steps", "flow:6", "--strategy-option", "flow:solver=heun") as (url, log):
        for name, words in (("masked", "strategy fast_dllm (steps=4 block_length=8 "
                                       "threshold=0.1)"),
                            ("flow", "strategy flow (steps=6 solver=heun)"),
                            ("tiny", "strategy autoregressive")):
            ready = log.wait_for(rf"model '{name}' ready in .*, 8 slots(.*)$")
            assert ready.group(1) == f", {words}"
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        answers = {
            name: client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=16,
                                                 temperature=0, seed=5)
            for name in ("masked", "flow")}
        listed = httpx.get(url + "/v1/models", headers={"authorization": f"Bearer {KEY}"},
                           timeout=30).json()
        sdk_listed = sorted(m.id for m in client.models.list())
        for name, answer in answers.items():
            trace = httpx.get(f"{url}/traces/{answer.id}",
                              headers={"authorization": f"Bearer {KEY}"}, timeout=30)
            (tmp_path / f"{name}.jsonl").write_text(trace.text)
        log.drain()
    assert all(LINE.match(line) for line in log.lines)
    assert answers["masked"].choices[0].message.content == library(
        masked, temperature=0, max_tokens=16, seed=5)
    assert answers["flow"].choices[0].message.content == library(
        flow, "tiny-flow", temperature=0, max_tokens=16, seed=5)
    # GET /v1/models: an iterative model is listed exactly as an autoregressive one is
    assert sdk_listed == ["flow", "masked", "tiny"]
    shapes = {m["id"]: {k: type(v).__name__ for k, v in m.items() if k != "id"}
              for m in listed["data"]}
    assert shapes["masked"] == shapes["flow"] == shapes["tiny"]
    assert set(listed) == {"object", "data"}
    got = configured(tmp_path / "masked.jsonl")
    assert {k: got[k] for k in ("sampler", "steps", "block_length", "threshold")} == {
        "sampler": "fast_dllm", "steps": 4, "block_length": 8, "threshold": 0.1}
    (loaded,) = load_all(tmp_path / "flow.jsonl")
    iterations = [e.payload for e in loaded.events if e.event_type == "step.iteration"]
    assert iterations and {(p["rule"], p["iterations"]) for p in iterations} == {
        ("heun", 2 * 6 - 1)}  # Heun: two calls a step, one for the last


@pytest.mark.parametrize("argv, says", [
    (["--model", "tiny-masked", "--strategy", "fast_dlm"],
     "pipeline serve: --strategy='fast_dlm': no such strategy (did you mean 'fast_dllm'?)"),
    (["--model", "m=tiny-masked", "--steps", "n:4"],
     "pipeline serve: --steps='n:4': no served model is named 'n' (served: m)"),
    (["--model", "tiny-masked", "--strategy-option", "threshold"],
     "pipeline serve: --strategy-option='threshold': write KEY=VALUE"),
])
def test_serve_refuses_bad_flags_before_listening(tmp_path: Path, argv: list[str],
                                                  says: str) -> None:
    done = subprocess.run(RUN + ["serve", "--port", "0", "--data-dir", str(tmp_path), *argv],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PIPELINE_API_KEYS": KEY})
    assert done.returncode == 2
    line, = done.stderr.strip().splitlines()
    assert line.startswith(says)


def test_serve_a_model_whose_options_do_not_fit_fails_naming_the_option(tmp_path: Path
                                                                       ) -> None:
    done = subprocess.run(RUN + ["serve", "--port", "0", "--data-dir", str(tmp_path),
                                 "--model", "m=tiny-masked", "--strategy", "fast_dllm",
                                 "--strategy-option", "treshold=0.9"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PIPELINE_API_KEYS": KEY})
    assert done.returncode == 1 and "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("pipeline serve: no model could be loaded ('m': ")
    assert "'treshold' (did you mean 'threshold'?)" in lines[-1]
    assert sum(" ERROR pipeline.serve: model 'm' failed to load" in x for x in lines) == 1


def test_build_takes_the_choice_as_one_value() -> None:
    # build(strategy=StrategyChoice(...)) is build(**choice.build_args()): the same tokens
    choice = StrategyChoice("fast_dllm", 4, 8, {"threshold": 0.5})
    with build("tiny-masked", strategy=choice) as pipe:
        assert pipe.engine is not None and pipe.engine.strategy(None).name == "fast_dllm"
        whole = pipe.generate(MESSAGES, temperature=0, max_tokens=16)
    assert whole.text == library(choice, temperature=0, max_tokens=16)
    with pytest.raises(InvalidValueError, match="steps.*StrategyChoice"):
        build("tiny-masked", strategy=choice, steps=2)
