"""What ``pipeline run`` and ``pipeline chat`` say on standard error while they start, and
after an answer.

Owns :func:`describe` (the model a command line names, with its size and precision, read from
the file system without loading anything), :class:`Loading` (the ``loading MODEL (98 MB,
Q4_1) ...`` line, on a terminal written at once, before the library imports torch, with an
elapsed-time count while a GGUF file loads (a folder's safetensors draw their own progress
bar, :mod:`backends.torch.loader`); then ``ready in 2.3 s: sampling temperature 0.2, top_p
0.9 (pipeline default)``), :func:`sampling_line` (the sampling a request of the command gets:
each value in effect and where it came from, a flag or the pipeline's defaults and their
source), :class:`Figures` (a finished request's speeds, as llama.cpp reports them) and the
lines made of them: :func:`summary_line` and :func:`verbose_lines`. With standard error not a
terminal both start lines are plain lines, written together once the model is ready (so an
error before that is the only line, as the command line's errors are).

Nothing here imports torch, so on a terminal the first line shows while the rest of the
library loads.

Example (standard error of ``pipeline run --model tiny --verbose "hi"``)::

    loading tiny (25 MB, bfloat16) ...
    ready in 1.9 s: sampling temperature 0.7, top_k 40, top_p 0.9, repetition_penalty 1.1
      (generation_config.json)
    ttft 41.0 ms | 160 tokens/s | finish length | prompt 9 tokens at 310 tokens/s | 16 tokens

and of ``pipeline run --temperature 0 "hi"`` on the default model::

    ready in 0.3 s: sampling greedy: temperature 0 (--temperature); unused when greedy: top_p
      0.9 (pipeline default)
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import attrs

if TYPE_CHECKING:  # importing them imports torch: the command line loads that only when used
    from pipeline.pipe import Pipeline
    from pipeline.contracts.output import Completion
    from pipeline.contracts.request import GenerationConfig

DEFAULT_NAME = "SmolLM2-135M-Instruct"
"""How the lines name the default model."""
QUANT = re.compile(r"(?i)(?:^|[._-])(I?Q\d(?:_[0-9A-Z]+)*|BF16|F16|F32)(?=[._-]|$)")
"""A GGUF file name's precision (``...Q4_1.gguf``, ``...-bf16.gguf``), as llama.cpp names
them."""
SPIN_AFTER_S = 0.5
"""The elapsed-time count starts when loading has taken this long (a quick load stays one
line)."""
SPIN_EVERY_S = 0.1


def describe(model: str | None) -> tuple[str, Path]:
    """``MODEL (size, precision)`` for the lines, and the file or folder ``model`` resolves
    to; a model that is nowhere is the :class:`~pipeline.errors.ArtifactError` ``build``
    would raise, before any line is written."""
    from pipeline.model_paths import DEFAULT_MODEL, resolve_model

    name = DEFAULT_NAME if model in (None, DEFAULT_MODEL) else str(model)
    where = resolve_model(model or DEFAULT_MODEL).path
    facts = [f for f in (_size(where), _precision(where)) if f]
    return (f"{name} ({', '.join(facts)})" if facts else name), where


def _size(where: Path) -> str | None:
    files = [where] if where.is_file() else list(where.glob("*.safetensors"))
    total = sum(f.stat().st_size for f in files if f.is_file())
    if not total:
        return None
    if total >= 1e9:
        return f"{total / 1e9:.1f} GB"
    return f"{total / 1e6:.0f} MB" if total >= 1e6 else f"{total / 1e3:.0f} kB"


def _precision(where: Path) -> str | None:
    if where.is_file():
        found = QUANT.search(where.stem)
        return found.group(1).upper() if found else "GGUF"
    try:
        config = json.loads((where / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    dtype = config.get("torch_dtype") or config.get("dtype") if isinstance(config, dict) else None
    return dtype if isinstance(dtype, str) else None


class Loading:
    """The start of a command: :meth:`begin` before anything loads, :meth:`ready` once the
    pipeline is built.

    On a terminal the loading line is written at once; while a single file (GGUF) loads it
    counts the seconds, while a folder loads the safetensors loader draws its own bar below
    it. Written to a file or a pipe, the two lines come together once the model is ready, so
    an error in the flags or the build stays the only line (the command line's rule for
    errors a user can cause) and a log gets the same plain lines."""

    def __init__(self, stream: TextIO, model: str | None) -> None:
        self.stream = stream
        self.what, where = describe(model)
        self.live = stream.isatty()
        self.count = self.live and where.is_file()
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def line(self) -> str:
        """``loading MODEL (size, precision) ...``."""
        return f"loading {self.what} ..."

    def begin(self) -> None:
        """Start the clock; on a terminal, write the loading line (left open for the count
        when a file loads)."""
        self.started = time.monotonic()
        if not self.live:
            return
        self._write(self.line + ("" if self.count else "\n"))
        if self.count:
            self._thread = threading.Thread(target=self._spin, name="pipeline-loading",
                                            daemon=True)
            self._thread.start()

    def _spin(self) -> None:
        if self._stop.wait(SPIN_AFTER_S):
            return
        while not self._stop.wait(SPIN_EVERY_S):
            self._write(f"\r{self.line} {time.monotonic() - self.started:.1f} s")

    def end(self) -> float:
        """Stop the count and end the loading line; the seconds since :meth:`begin`."""
        elapsed = time.monotonic() - self.started
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self._write(f"\r{self.line} {elapsed:.1f} s\n")
        return elapsed

    def ready(self, pipe: Pipeline, given: Mapping[str, tuple[Any, str]] | None = None
              ) -> None:
        """End the loading line (off a terminal: write it now) and write ``ready in N.N s:
        sampling ...``: :func:`sampling_line` of the pipeline's defaults with ``given`` (field
        → (value, the flag that set it)) laid over them."""
        elapsed = self.end()
        head = "" if self.live else self.line + "\n"
        line = sampling_line(pipe.defaults, pipe.defaults_source, given or {})
        self._write(f"{head}ready in {elapsed:.1f} s: {line}\n")

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    @contextmanager
    def loading(self) -> Iterator[Loading]:
        """:meth:`begin` now, :meth:`end` when the block leaves by an exception (a failed
        load leaves no count running); the block calls :meth:`ready` itself."""
        self.begin()
        try:
            yield self
        except BaseException:
            self.end()
            raise


def sampling_line(defaults: GenerationConfig, source: str,
                  given: Mapping[str, tuple[Any, str]]) -> str:
    """``sampling temperature 0 (--temperature), top_p 0.9 (pipeline default)``: the
    sampling a request gets when ``given`` (field → (value, where it was set)) is laid over
    ``defaults`` (which came from ``source``), each value with where it came from (a run of
    values from one place names it once, after the last).

    Shown: temperature, every field of ``defaults`` that is not neutral (whatever fields the
    defaults hold), and each sampling field given. At temperature 0 the truncation fields
    (:data:`~pipeline.sampling_defaults.UNUSED_WHEN_GREEDY`) do nothing and are listed apart as unused."""
    from pipeline.sampling_defaults import SAMPLING_FIELDS, UNUSED_WHEN_GREEDY
    from pipeline.contracts.request import GenerationConfig

    neutral = GenerationConfig()
    effective = attrs.evolve(defaults, **{f: value for f, (value, _) in given.items()})
    shown = [f.name for f in attrs.fields(GenerationConfig)
             if f.name == "temperature" or _differs(defaults, neutral, f.name)
             or (f.name in given and f.name in SAMPLING_FIELDS)]
    placed = [(f"{name} {_shown(getattr(effective, name))}",
               given[name][1] if name in given else source) for name in shown]
    if not effective.greedy:
        return f"sampling {_grouped(placed)}"
    used = [p for name, p in zip(shown, placed) if name not in UNUSED_WHEN_GREEDY]
    unused = [p for name, p in zip(shown, placed) if name in UNUSED_WHEN_GREEDY]
    tail = f"; unused when greedy: {_grouped(unused)}" if unused else ""
    return f"sampling greedy: {_grouped(used)}{tail}"


def _differs(config: GenerationConfig, neutral: GenerationConfig, name: str) -> bool:
    value = getattr(config, name)
    return bool(value != getattr(neutral, name)) if name != "logit_bias" else bool(value)


def _shown(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    return f"{value:g}"


def _grouped(placed: list[tuple[str, str]]) -> str:
    """``a 1, b 2 (x), c 3 (y)``: each value, its source after the last of a run from it."""
    out = []
    for i, (text, where) in enumerate(placed):
        last = i + 1 == len(placed) or placed[i + 1][1] != where
        out.append(f"{text} ({where})" if last else text)
    return ", ".join(out)


@attrs.frozen
class Figures:
    """A finished request's figures: time to first token, prompt tokens computed and the
    prefill's speed, tokens generated and the decode's speed over the decode alone (the time
    after the first token, for the tokens after it), and why it ended."""

    ttft_s: float | None
    prompt_tokens: int
    cached_tokens: int
    prefill_s: float | None
    generated: int
    decode_s: float | None
    finish: str

    @classmethod
    def of(cls, done: Completion) -> Figures:
        """The figures of ``done`` (from its timings and usage)."""
        t = done.timings
        prefill = None if t.first_token_s is None else max(t.first_token_s - t.queued_s, 0.0)
        decode = None if t.first_token_s is None else max(t.total_s - t.first_token_s, 0.0)
        return cls(t.first_token_s, done.usage.prompt_tokens, done.usage.cached_tokens, prefill,
                   done.usage.completion_tokens, decode, done.finish_reason.value)

    @property
    def prefill_rate(self) -> float | None:
        """Prompt tokens computed (cached ones are not) per second of prefill."""
        computed = self.prompt_tokens - self.cached_tokens
        return computed / self.prefill_s if self.prefill_s else None

    @property
    def decode_rate(self) -> float | None:
        """Tokens after the first per second after the first (None for one token or none)."""
        if self.generated < 2 or not self.decode_s:
            return None
        return (self.generated - 1) / self.decode_s


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def summary_line(figures: Figures) -> str:
    """``ttft 95.1 ms | 18 tokens/s | finish eos | prompt 32 tokens at 336 tokens/s |
    41 tokens``: ``make demo``'s summary with the prompt and the count added."""
    ttft = "-" if figures.ttft_s is None else f"{figures.ttft_s * 1e3:.1f}"
    return (f"ttft {ttft} ms | {_rate(figures.decode_rate)} tokens/s | finish {figures.finish}"
            f" | prompt {figures.prompt_tokens} tokens at {_rate(figures.prefill_rate)} "
            f"tokens/s | {figures.generated} tokens")


def verbose_lines(figures: Figures) -> list[str]:
    """The figures one per line, as ``llama-cli`` prints its timings."""
    def ms(seconds: float | None) -> str:
        return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"

    cached = f" ({figures.cached_tokens} cached)" if figures.cached_tokens else ""
    return [
        f"time to first token = {ms(figures.ttft_s)}",
        f"prompt eval = {ms(figures.prefill_s)} / {figures.prompt_tokens} tokens{cached} "
        f"({_rate(figures.prefill_rate)} tokens per second)",
        f"eval = {ms(figures.decode_s)} / {max(figures.generated - 1, 0)} tokens after the "
        f"first ({_rate(figures.decode_rate)} tokens per second)",
        f"generated = {figures.generated} tokens, finish {figures.finish}",
    ]
