"""A start that talks, and one sampling default everywhere.

- ``pipeline run`` writes ``loading MODEL (size, precision) ...`` first on standard error,
  then ``ready in N.N s: sampling ... (source)``; ``--verbose`` adds the run's figures (time
  to first token, prompt tokens and prefill speed, tokens generated and decode speed, finish
  reason), which must agree with the run's own ``--json`` timings and usage.
- ``pipeline chat`` in a pseudo-terminal: the loading line is its first output, and it comes
  before torch (and the weights' loader) is imported, by the order of the child's own
  ``-X importtime`` lines on the same terminal, not by a stopwatch.
- The defaults: a model folder's ``generation_config.json`` (``do_sample: false`` is no
  recommendation), a GGUF file's ``general.sampling.*`` keys written with ``gguf.GGUFWriter``,
  the pipeline default for a model that says nothing; ``build(defaults=...)`` and per-call
  keywords over them.
- The server: a request that leaves the sampling fields out gets the served pipeline's
  defaults (the trace's ``request.normalized`` config), one that sets a field keeps it.
"""

from __future__ import annotations

import io
import json
import os
import pty
import re
import select
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pipeline.gguf_file import GGUFFile
from pipeline import GenerationConfig, build
from transports import cli
from transports.cli.start import (
    SPIN_AFTER_S, SPIN_EVERY_S, Figures, Loading, sampling_line, summary_line,
)
from pipeline.errors import ArtifactError
from pipeline.events import Event
from pipeline.model_paths import TINY_MODEL_DIR
from pipeline.sampling_defaults import (
    CALLER, GENERATION_CONFIG, GGUF_METADATA, PIPELINE, PIPELINE_DEFAULT, from_generation_config,
    model_sampling,
)
from pipeline.testing import ScriptedBackend, build_scripted, peaked
from stages.tokenize import HFTokenizer
from tests.http_support import config, endless_model, running
from transports.http import Gateway, ServerConfig

gguf = pytest.importorskip("gguf")

TINY_SAMPLING = {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "repetition_penalty": 1.1}
"""What the package's tiny model's generation_config.json recommends."""
READY = re.compile(r"^ready in \d+\.\d s: sampling (.+) \((.+)\)$")


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, list[str]]:
    code = cli.main(["run", "--model", "tiny", *argv])
    out, err = capsys.readouterr()
    return code, out, [line for line in err.splitlines() if line.strip()]


# --- pipeline run --------------------------------------------------------------------------

def test_run_says_loading_then_ready_with_the_defaults_and_their_source(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "--max-tokens", "3", "--seed", "1", "hi")
    assert code == 0 and out.strip()
    assert re.fullmatch(r"loading tiny \(\d+ MB, bfloat16\) \.\.\.", err[0]), err
    ready = READY.match(err[1])
    assert ready, err
    assert ready.group(1) == "temperature 0.7, top_k 40, top_p 0.9, repetition_penalty 1.1"
    assert ready.group(2) == GENERATION_CONFIG
    assert len(err) == 2, "no summary when the answer does not go to a terminal"


def test_run_verbose_reports_what_the_run_measured(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "--max-tokens", "5", "--min-tokens", "5", "--seed", "3",
                          "--verbose", "--json", "hi")
    assert code == 0
    run = json.loads(out)
    figures = "\n".join(err[2:])
    ttft = re.search(r"time to first token = ([\d.]+) ms", figures)
    assert ttft and float(ttft.group(1)) == pytest.approx(run["timings"]["first_token_s"] * 1e3,
                                                          abs=0.06)
    prompt = re.search(r"prompt eval = ([\d.]+) ms / (\d+) tokens \((\d+) tokens per second\)",
                       figures)
    assert prompt and int(prompt.group(2)) == run["usage"]["prompt_tokens"]
    prefill_s = run["timings"]["first_token_s"] - run["timings"]["queued_s"]
    assert float(prompt.group(1)) == pytest.approx(prefill_s * 1e3, abs=0.06)
    decode = re.search(r"eval = ([\d.]+) ms / (\d+) tokens after the first "
                       r"\((\d+) tokens per second\)", figures.split("prompt eval")[1])
    decode_s = run["timings"]["total_s"] - run["timings"]["first_token_s"]
    assert decode and int(decode.group(2)) == run["usage"]["completion_tokens"] - 1 == 4
    assert float(decode.group(1)) == pytest.approx(decode_s * 1e3, abs=0.06)
    assert int(decode.group(3)) == round(4 / decode_s)  # the decode alone, not the ttft
    assert f"generated = 5 tokens, finish {run['finish_reason']}" in figures


def test_run_threads_sets_the_count_and_says_it(capsys: pytest.CaptureFixture[str],
                                                 tmp_path: Path) -> None:
    import torch

    from pipeline.trace import load

    before = torch.get_num_threads()
    trace = tmp_path / "run.jsonl"
    try:
        code, _, err = _run(capsys, "--max-tokens", "3", "--threads", "1", "--verbose",
                            "--trace", str(trace), "hi")
    finally:
        torch.set_num_threads(before)
    assert code == 0
    assert "threads = 1 (the threads option)" in err
    assert load(trace).instance["threads"] == "1"
    # without the flag, torch's count, with each decode step's count chosen by measuring
    code, _, err = _run(capsys, "--max-tokens", "3", "--verbose", "hi")
    said = [line for line in err if line.startswith("threads = ")]
    assert code == 0 and len(said) == 1
    assert (said[0] == "threads = 1 (torch's count is 1)" if before == 1 else
            re.fullmatch(rf"threads = [1-{before}] of {before}, chosen by measuring decode "
                         r"steps( \(.*ms a step\))?", said[0])), said


@pytest.mark.parametrize("bad", ["0", "-2", "two", "1.5", "5000"])
def test_run_refuses_a_thread_count_that_is_not_one(capsys: pytest.CaptureFixture[str],
                                                    bad: str) -> None:
    with pytest.raises(SystemExit) as stop:
        cli.main(["run", "--model", "tiny", "--threads", bad, "hi"])
    assert stop.value.code == 2
    assert f"'{bad}' is not a thread count" in capsys.readouterr().err


def test_run_flags_override_the_models_defaults(capsys: pytest.CaptureFixture[str],
                                                tmp_path: Path) -> None:
    trace = tmp_path / "run.jsonl"
    code, _, _ = _run(capsys, "--max-tokens", "2", "--temperature", "0", "--trace", str(trace),
                      "hi")
    assert code == 0
    events = [Event.from_json(json.loads(line)) for line in trace.read_text().splitlines()]
    config = next(e for e in events if e.event_type == "request.normalized").payload
    assert config["generation_config"]["temperature"] == 0
    assert config["generation_config"]["top_p"] == TINY_SAMPLING["top_p"]  # laid over them


SHOWN = re.compile(r"(\w+) ([^,;() ]+)(?: \((.+?)\))?(?=, |$)")


def _listed(part: str) -> dict[str, tuple[str, str]]:
    """``a 1, b 2 (x), c 3 (y)`` → field → (value, source): a value without a source takes
    the next one's (a run of values from one place names it once, after the last)."""
    found = SHOWN.findall(part)
    assert ", ".join(f"{n} {v}" + (f" ({w})" if w else "") for n, v, w in found) == part
    out: dict[str, tuple[str, str]] = {}
    where = ""
    for name, value, source in reversed(found):
        where = source or where
        out[name] = (value, where)
    assert found[-1][2], "the last value names its source"
    return out


def _ready_line(err: list[str]) -> tuple[bool, dict[str, tuple[str, str]],
                                          dict[str, tuple[str, str]]]:
    """The ready line as (greedy, values in effect, values unused when greedy)."""
    ready = next(line for line in err if line.startswith("ready in "))
    text = re.sub(r"^ready in \d+\.\d s: sampling ", "", ready)
    greedy = text.startswith("greedy: ")
    used, _, unused = text.removeprefix("greedy: ").partition("; unused when greedy: ")
    return greedy, _listed(used), (_listed(unused) if unused else {})


@pytest.mark.parametrize("flags", [
    {},
    {"--temperature": "0"},
    {"--temperature": "0.5", "--top-k": "3", "--min-p": "0.05"},
    {"--top-p": "0.5", "--repetition-penalty": "1.3"},
])
def test_the_ready_line_shows_the_values_in_effect_and_where_each_came_from(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, flags: dict[str, str]) -> None:
    """The oracle is the configuration the engine ran (the trace's ``request.normalized``):
    every sampling value listed is that one's, and every one that is not neutral is listed;
    each names the flag that set it, or the model's generation_config.json; at temperature 0
    the truncation fields are said to be unused, not listed as in effect."""
    trace = tmp_path / "run.jsonl"
    argv = [x for pair in flags.items() for x in pair]
    code, _, err = _run(capsys, "--max-tokens", "2", "--trace", str(trace), *argv, "hi")
    assert code == 0
    events = [Event.from_json(json.loads(line)) for line in trace.read_text().splitlines()]
    ran = next(e for e in events if e.event_type == "request.normalized"
               ).payload["generation_config"]
    greedy, used, unused = _ready_line(err)
    assert greedy == (ran["temperature"] == 0)
    for name, (value, source) in {**used, **unused}.items():
        assert float(value) == pytest.approx(ran[name]), name
        flag = f"--{name.replace('_', '-')}"
        assert source == (flag if flag in flags else GENERATION_CONFIG), name
    neutral = GenerationConfig()
    sampling = ("temperature", "top_k", "top_p", "min_p", "typical_p", "repetition_penalty")
    assert {f for f in sampling if ran[f] != getattr(neutral, f)} <= {*used, *unused}
    truncation = {"top_k", "top_p", "min_p", "typical_p"}
    assert set(unused) == ({*used, *unused} & truncation if greedy else set())
    assert not (greedy and set(used) & truncation)


def test_the_ready_line_shows_whatever_fields_the_defaults_hold() -> None:
    """Defaults with fields beyond the usual sampling ones (as ``build(defaults=...)`` may
    give, or a future pipeline default) are listed too, with their source."""
    defaults = GenerationConfig(temperature=0.3, min_p=0.05, presence_penalty=0.5,
                                max_tokens=64)
    line = sampling_line(defaults, CALLER, {"temperature": (0.9, "--temperature")})
    listed = _listed(line.removeprefix("sampling "))
    assert listed == {"temperature": ("0.9", "--temperature"),
                      "max_tokens": ("64", CALLER), "min_p": ("0.05", CALLER),
                      "presence_penalty": ("0.5", CALLER)}


def test_run_help_states_the_documented_default_and_that_the_model_comes_first(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    default = ", ".join(f"{k} {v:g}" for k, v in PIPELINE_DEFAULT.items())
    assert f"samples at {default}" in text
    assert "model's own recommended value" in text and "--verbose" in text


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Ticks:
    """Stands for the loading line's stop event: each of the first ``ticks`` waits returns at
    once as if its timeout had passed (moving ``now`` on by it); the next one blocks, setting
    :attr:`waiting`, until :meth:`set`."""

    def __init__(self, ticks: int, now: list[float]) -> None:
        self.left, self.now = ticks, now
        self.waiting, self._set = threading.Event(), threading.Event()

    def wait(self, timeout: float) -> bool:
        if self.left and not self._set.is_set():
            self.left -= 1
            self.now[0] += timeout
            return False
        self.waiting.set()
        return self._set.wait(120)

    def set(self) -> None:
        self._set.set()

    def is_set(self) -> bool:
        return self._set.is_set()


def test_on_a_terminal_a_gguf_load_counts_its_seconds_on_the_loading_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _gguf(tmp_path / "m-Q8_0.gguf")
    stream = _Terminal()
    now = [1000.0]
    # the count's clock and its waits, virtual: three ticks of the count, then it waits on
    monkeypatch.setattr(sys.modules[Loading.__module__], "time",
                        type("Clock", (), {"monotonic": staticmethod(lambda: now[0])}))
    start = Loading(stream, str(path))
    ticks = _Ticks(1 + 3, now)
    start._stop = ticks  # type: ignore[assignment]
    start.begin()
    assert re.fullmatch(rf"loading {re.escape(str(path))} \(\d+ kB, Q8_0\) \.\.\.",
                        stream.getvalue().split("\r")[0])  # at once, and left open for the count
    assert ticks.waiting.wait(120), "the count never reached its fourth tick"  # a hang guard
    with build_scripted(ScriptedBackend(259, peaked(259, lambda ids: 65))) as pipe:
        start.ready(pipe)
    shown = stream.getvalue().split("\r")
    assert len(shown) >= 3 and all(re.fullmatch(r"loading .+ \.\.\. \d+\.\d s", s)
                                   for s in shown[1:-1])
    last, ready = shown[-1].splitlines()
    assert re.fullmatch(r"loading .+ \.\.\. \d+\.\d s", last)
    assert ready.endswith(f"({PIPELINE})") and ready.startswith("ready in ")


def test_the_summary_line_has_make_demos_shape_and_the_prompt() -> None:
    with build_scripted(ScriptedBackend(259, peaked(259, lambda ids: 65))) as pipe:
        done = pipe.generate("hi", max_tokens=4, temperature=0)
    line = summary_line(Figures.of(done))
    assert re.match(r"ttft [\d.]+ ms \| \d+ tokens/s \| finish length \| ", line)  # the demo's
    assert line.endswith(f"prompt {done.usage.prompt_tokens} tokens at "
                         f"{Figures.of(done).prefill_rate:.0f} tokens/s | 4 tokens")


# --- pipeline chat in a pseudo-terminal ----------------------------------------------------

def _read_until(fd: int, marker: bytes, deadline: float, got: bytearray,
                times: list[tuple[float, int]]) -> None:
    while marker not in got:
        left = deadline - time.monotonic()
        assert left > 0, f"no {marker!r} in time; output so far: {bytes(got[-2000:])!r}"
        ready, _, _ = select.select([fd], [], [], min(left, 1.0))
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the child closed the terminal
                break
            times.append((time.monotonic(), len(got)))
            got.extend(chunk)


def test_chat_shows_its_loading_line_first_and_before_torch_is_imported() -> None:
    main, child = pty.openpty()
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1", "TERM": "dumb"}
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "chat", "--model", "tiny"],
                            stdin=child, stdout=child, stderr=child, env=env, close_fds=True)
    os.close(child)
    got, times = bytearray(), []  # type: ignore[var-annotated]
    try:
        _read_until(main, b">>> ", started + 120, got, times)
        os.write(main, b"/exit\n")
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(main)
    text = got.decode("utf-8", "replace").replace("\r\n", "\n")
    lines = [line for line in text.split("\n") if line.strip()]
    own = [line for line in lines if not line.startswith("import time:")]
    assert own[0].startswith("loading tiny ("), own[:3]
    at = text.index("loading tiny (")
    torch_at = re.search(r"\|\s+torch[.\s]", text)
    loader_at = text.find("backends.torch.loader")
    assert torch_at and at < torch_at.start(), "the line comes before torch is imported"
    assert 0 <= loader_at and at < loader_at, "and before the weights' loader"
    offset = got.index(b"loading tiny (")
    shown = next(t for t, size in times if size + 65536 > offset and size <= offset)
    # only the interpreter starts before it: no library heavier than attrs is imported first
    # (read from the child's own import-time lines, not a stopwatch)
    modules = {m.group(1) for m in re.finditer(
        r"import time:\s+\d+ \|\s+\d+ \|\s*(\S+)", text[:at])}
    before = {name.split(".")[0] for name in modules}
    heavy = {"torch", "numpy", "jinja2", "tokenizers", "safetensors", "gguf", "transformers",
             "uvicorn", "starlette", "httpx", "prometheus_client", "backends", "stages"}
    assert "pipeline" in before and not before & heavy, sorted(before & heavy)
    # the command line is a transport; the server and the Ray front are not loaded for chat
    assert not {m for m in modules if m.startswith(("transports.http", "transports.ray_serve"))}
    ready = next(line for line in own if line.startswith("ready in"))
    assert READY.match(ready) and "(generation_config.json)" in ready
    banner = own[own.index(ready) + 1]
    assert banner.startswith("pipeline chat: tiny (") and "/help" in banner


# --- where the defaults come from ----------------------------------------------------------

def _folder(tmp_path: Path, generation: dict[str, object] | None) -> Path:
    """The tiny model's tokenizer files (no weights: building it is quick) and ``generation``
    as its generation_config.json."""
    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_MODEL_DIR / name, folder / name)
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def test_a_folders_generation_config_gives_the_defaults(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"do_sample": True, "temperature": 0.3, "top_p": 0.8,
                                "eos_token_id": 2, "typical_p": 0.5})
    with build(folder) as pipe:
        assert pipe.defaults_source == GENERATION_CONFIG
        assert (pipe.defaults.temperature, pipe.defaults.top_p) == (0.3, 0.8)
        assert (pipe.defaults.top_k, pipe.defaults.min_p) == (0, 0.0)  # not named: off
        request = pipe.request("hi", top_p=0.5)
        assert (request.generation_config.temperature, request.generation_config.top_p) == (
            0.3, 0.5)
    assert model_sampling(folder, None).ignored == ("typical_p",)
    with build(folder, defaults=GenerationConfig(temperature=0)) as pipe:
        assert pipe.defaults_source == CALLER and pipe.defaults.greedy
        assert pipe.defaults.top_p == 1.0  # the caller's config whole, nothing of the model's


@pytest.mark.parametrize("generation", [None, {"do_sample": False, "temperature": 0.3},
                                        {"eos_token_id": 2}])
def test_a_model_that_recommends_nothing_gets_the_pipeline_default(
        tmp_path: Path, generation: dict[str, object] | None) -> None:
    with build(_folder(tmp_path, generation)) as pipe:
        assert pipe.defaults_source == PIPELINE
        assert pipe.defaults == GenerationConfig(**PIPELINE_DEFAULT)


def test_stages_without_a_model_get_the_pipeline_default() -> None:
    backend = ScriptedBackend(259, peaked(259, lambda ids: 65))
    with build_scripted(backend) as pipe:
        assert pipe.defaults_source == PIPELINE
        assert pipe.defaults == GenerationConfig(**PIPELINE_DEFAULT)


def test_a_bad_recommendation_names_the_file_and_key(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match=r"generation_config.json.*top_p"):
        build(_folder(tmp_path, {"top_p": 3}))


@pytest.mark.parametrize("text, key", [('{"top_k": Infinity}', "top_k"),
                                       ('{"top_k": 1e400}', "top_k"),
                                       ('{"temperature": NaN}', "temperature"),
                                       ('{"top_k": 1.5}', "top_k")])
def test_a_non_finite_or_fractional_recommendation_is_refused_not_a_crash(
        tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / GENERATION_CONFIG
    path.write_text(text)  # Python's json reads Infinity and NaN
    with pytest.raises(ArtifactError, match=rf"{GENERATION_CONFIG}: {key} must be a"):
        from_generation_config(path)


def test_a_null_in_a_generation_config_says_nothing(tmp_path: Path) -> None:
    path = tmp_path / GENERATION_CONFIG
    path.write_text('{"temperature": null, "top_p": 0.8}')
    found = from_generation_config(path)
    assert found is not None and found.config.top_p == 0.8 and found.config.temperature == 1.0


def _gguf(path: Path, **sampling: float) -> Path:
    """A GGUF file of metadata alone (tokenizer and weights come from elsewhere), with
    ``general.sampling.*`` keys written by the writer's own methods."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in sampling.items():
        getattr(writer, f"add_sampling_{key}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_pipe(path: Path, **kwargs: object) -> object:
    tok = HFTokenizer.from_dir(TINY_MODEL_DIR)
    backend = ScriptedBackend(tok.vocab_size, peaked(tok.vocab_size, lambda ids: 65))
    return build(path, tokenizer=tok, backend=backend, **kwargs)  # type: ignore[arg-type]


def test_a_gguf_files_sampling_metadata_gives_the_defaults(tmp_path: Path) -> None:
    path = _gguf(tmp_path / "m.gguf", temp=0.4, top_k=20, top_p=0.95, min_p=0.05,
                 penalty_repeat=1.05, mirostat=0)
    with _gguf_pipe(path) as pipe:  # type: ignore[attr-defined]
        assert pipe.defaults_source == GGUF_METADATA
        d = pipe.defaults
        assert (d.temperature, d.top_k, d.min_p) == (pytest.approx(0.4), 20, pytest.approx(0.05))
        assert (d.top_p, d.repetition_penalty) == (pytest.approx(0.95), pytest.approx(1.05))
        done = pipe.generate("hi", max_tokens=2, seed=1)
        events = {e.event_type: e.payload for e in done.trace}
        assert events["request.normalized"]["generation_config"]["top_k"] == 20
        assert {"temperature", "top_k", "top_p", "min_p", "repetition_penalty"} <= set(
            events["selection.configured"]["processors"])
        greedy = pipe.generate("hi", max_tokens=2, temperature=0)  # a keyword wins
        assert greedy.trace[1].payload["generation_config"]["temperature"] == 0
    assert model_sampling(None, path, gguf_metadata=GGUFFile.open(path).metadata).ignored == (
        "general.sampling.mirostat",)
    with _gguf_pipe(path, defaults=GenerationConfig(top_k=3)) as pipe:  # type: ignore[attr-defined]
        assert pipe.defaults_source == CALLER and pipe.defaults.top_k == 3
    plain = _gguf(tmp_path / "plain.gguf")
    assert model_sampling(None, plain, gguf_metadata=GGUFFile.open(plain).metadata
                          ).source == PIPELINE
    assert model_sampling(None, path).source == PIPELINE  # no metadata given: none read


# --- the server ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    def builder(folder: Path | None, cfg: ServerConfig) -> object:
        return endless_model()[0]  # over the tiny model's folder: its generation_config

    cfg = config(tmp_path_factory.mktemp("defaults"))
    with running(Gateway(cfg, builder)) as url:  # type: ignore[arg-type]
        yield url


def _configured(url: str, response: httpx.Response) -> dict[str, object]:
    assert response.status_code == 200, response.text
    trace = httpx.get(f"{url}/traces/{response.headers['x-request-id']}")
    events = [json.loads(line) for line in trace.text.splitlines()]
    normalized = next(e for e in events if e["event_type"] == "request.normalized")
    return normalized["payload"]["generation_config"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_a_request_without_sampling_fields_gets_the_models_defaults(
        server: str, path: str, body: dict[str, object]) -> None:
    asked = httpx.post(f"{server}{path}", json={"model": "default", "max_tokens": 2, **body})
    got = _configured(server, asked)
    assert {k: got[k] for k in TINY_SAMPLING} == TINY_SAMPLING
    told = httpx.post(f"{server}{path}", json={"model": "default", "max_tokens": 2,
                                              "temperature": 1.0, **body})
    got = _configured(server, told)
    assert got["temperature"] == 1.0 and got["top_p"] == TINY_SAMPLING["top_p"]
