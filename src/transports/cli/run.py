"""The ``pipeline run`` command: one prompt, the answer streamed to the terminal
(docs/design.md §14).

Owns the command's options (the sampling fields people use, in the spellings of
``llama-cli`` and ``mlx_lm.generate``; ``--device`` and ``--dtype``, which become the build's
:class:`~pipeline.options.BackendOptions`, checked before the model loads) and its output:
the text as it streams, or with ``--json`` one JSON object (text, finish reason, usage,
timings, request id) on stdout; ``--trace FILE`` keeps the request's JSONL trace, at the
level ``--record`` names (``digest``, the default: digests of every data product; ``full``:
also their content, the text and token ids, so ``pipeline trace show`` lists each token's
text); ``--json-schema`` constrains the answer to a JSON schema (a file or inline JSON). The
prompt is the argument, or standard input when the argument is ``-`` or absent. Standard
error gets the start lines (:mod:`transports.cli.start`: loading, then ready with the sampling
in effect, each value with its source: the flag that set it or where the defaults came from)
and, after the answer, the run's figures: with ``--verbose`` time to first token, prompt
tokens and prefill speed, tokens generated and decode speed, finish reason; without it one
summary line when the answer went to a terminal. A flag left out (``--max-tokens`` included)
takes the pipeline's defaults (:mod:`pipeline.sampling_defaults`). The strategy flags
(``--strategy``, ``--steps``, ``--block-length``, ``--strategy-option``) are
:mod:`transports.cli.strategy`'s. ``pipeline chat`` takes the same flags through
:func:`add_sampling`, :func:`sampling_params`, :func:`given_flags`, :func:`add_record`,
:func:`add_backend` and :func:`backend_options`.

Example::

    pipeline run "Why is the sky blue?" --temperature 0 --max-tokens 64
    echo "2+2?" | pipeline run --model tiny --json
    pipeline run --model tiny-masked --strategy fast_dllm --steps 4 "What is a list?"
    pipeline run --trace run.jsonl --record full "hi" && pipeline trace show run.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transports.cli.start import Figures, Loading, summary_line, verbose_lines
from transports.cli.strategy import add_strategy, build_with, strategy_choice
from pipeline.errors import InvalidValueError
from pipeline.sampling_defaults import PIPELINE_DEFAULT
from pipeline.contracts.request import DEFAULT_MAX_TOKENS, GenerationConfig, Recording, TapWindow

if TYPE_CHECKING:  # importing them imports torch: the command line loads that only when used
    from pipeline.options import BackendOptions
    from pipeline.contracts.output import Completion
    from pipeline.pipe import Pipeline

_MODEL_DEFAULT = "(default: the model's own)"
_SAMPLING = (  # flag, GenerationConfig field, type, help
    ("--temperature", "temperature", float, f"0 is greedy {_MODEL_DEFAULT}"),
    ("--top-p", "top_p", float, f"nucleus mass to keep {_MODEL_DEFAULT}"),
    ("--top-k", "top_k", int, f"most likely tokens to keep, 0: all {_MODEL_DEFAULT}"),
    ("--min-p", "min_p", float, f"keep tokens at least this × the top probability "
                                f"{_MODEL_DEFAULT}"),
    ("--repetition-penalty", "repetition_penalty", float,
     f"divide repeated tokens' logits {_MODEL_DEFAULT}"),
    ("--dry-multiplier", "dry_multiplier", float,
     "the loop guard: penalize tokens that would extend a repeated run of the answer, "
     "0: off (default: the pipeline's, 0.8)"),
    ("--seed", "seed", int, "seed of the counter-based sampler (a run replays exactly)"),
    ("--max-tokens", "max_tokens", int, f"most tokens to generate (default "
                                        f"{DEFAULT_MAX_TOKENS}, as for every request)"),
    ("--min-tokens", "min_tokens", int, "fewest tokens before EOS or a stop string may end"),
)


def add_parser(sub: Any) -> None:
    """The ``run`` subcommand."""
    run = sub.add_parser("run", help="answer one prompt, streaming to the terminal")
    run.add_argument("prompt", nargs="?", default="-",
                     help="the user's message (default or '-': read standard input)")
    run.add_argument("--model", default=None,
                     help="a model folder, GGUF file, name (smollm2, tiny) or cached repo id "
                          "(default: SmolLM2-135M-Instruct)")
    run.add_argument("--system", default=None, help="a system message before the prompt")
    run.add_argument("--json-schema", default=None, metavar="SCHEMA",
                     help="a JSON schema the answer must validate against (by construction): "
                          "a file, or the schema itself as JSON")
    add_sampling(run)
    add_backend(run)
    add_strategy(run)
    run.add_argument("--json", action="store_true", help="print one JSON object at the end")
    run.add_argument("--trace", type=Path, default=None, metavar="FILE",
                     help="write the request's trace as JSONL to FILE")
    add_record(run)
    run.add_argument("--verbose", "-v", action="store_true",
                     help="after the answer, print on standard error the time to first token, "
                          "the prompt's tokens and prefill speed, the tokens generated and the "
                          "decode speed (after the first token), and the finish reason (without "
                          "it, one summary line when the answer goes to a terminal)")
    run.set_defaults(run=_run)


SAMPLING_HELP = (
    "A flag left out takes the model's own recommended value (its generation_config.json, "
    "or a GGUF file's general.sampling.* metadata); a model that recommends none samples at "
    + ", ".join(f"{k} {v:g}" for k, v in PIPELINE_DEFAULT.items())
    + ". The ready line on standard error shows the values in effect and their source.")
"""The sampling flags' group description (what ``--help`` says about their defaults)."""


def add_sampling(parser: Any) -> None:
    """The sampling flags (``--temperature`` ... ``--max-tokens``) and ``--stop``."""
    group = parser.add_argument_group("sampling", SAMPLING_HELP)
    for flag, field, kind, text in _SAMPLING:
        group.add_argument(flag, dest=field, type=kind, default=None, help=text)
    group.add_argument("--stop", action="append", default=None, metavar="TEXT",
                       help="stop before this text (repeatable)")


RECORDS = tuple(r.value for r in Recording)
"""``--record`` values, the trace's recording levels (:class:`~pipeline.contracts.request.Recording`)."""


def add_record(parser: Any) -> None:
    """``--record digest|full|taps``: the level of the trace ``--trace`` writes, and
    ``--tap-tensors STEP:FIRST-LAST``: the hidden states a ``taps`` trace keeps whole."""
    parser.add_argument("--record", default=None, metavar="LEVEL",
                        help="what the --trace file records: digest (the default: a digest "
                             "of every data product), full (also the text and token ids, "
                             "so `pipeline trace show` lists each token's text) or taps "
                             "(also each layer's hidden state per step, as a digest and "
                             "statistics, so `pipeline trace diff` finds the first layer "
                             "that differs)")
    parser.add_argument("--tap-tensors", default=None, metavar="STEP:FIRST-LAST",
                        help="with --record taps: keep the hidden states of step STEP's "
                             "layers FIRST to LAST whole (e.g. 1:0-3), so a diff measures "
                             "their difference")


def recording(args: argparse.Namespace) -> Recording | None:
    """``--record``'s level (None: not given); another value is one line listing the
    levels, and a level without ``--trace`` would record into nothing: also an error."""
    value = args.record
    if value is None:
        return None
    if value not in RECORDS:
        raise InvalidValueError("--record", value, f"must be one of {', '.join(RECORDS)}")
    if args.trace is None:
        raise InvalidValueError("--record", value, "sets the level of the trace --trace FILE "
                                                   "writes: give --trace too")
    return Recording(value)


def tap_window(args: argparse.Namespace) -> TapWindow | None:
    """``--tap-tensors``'s window (None: not given); it needs ``--record taps``."""
    value = getattr(args, "tap_tensors", None)
    if value is None:
        return None
    if args.record != Recording.TAPS.value:
        raise InvalidValueError("--tap-tensors", value, "keeps tensors in a trace recorded "
                                "with layer taps: give --record taps too")
    return TapWindow.parse(value)


def add_backend(parser: Any) -> None:
    """The backend flags: ``--backend``, ``--device``, ``--dtype``, ``--quantized`` and
    ``--batch-invariant``."""
    parser.add_argument("--backend", default=None, metavar="NAME",
                        help="the model backend: torch (a model folder's default), gguf (a "
                             "GGUF file's), transformers (any causal LM transformers loads; "
                             "the optional extra explicit-pipeline[transformers])")
    parser.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:N, mps)")
    parser.add_argument("--dtype", default=None,
                        help="compute dtype (float32, bfloat16, float16; default: the model's)")
    add_invariance(parser)


INVARIANCE = {"auto": None, "on": True, "off": False}
"""``--batch-invariant`` values → ``BackendOptions.batch_invariant``."""


def add_invariance(parser: Any) -> None:
    """``--batch-invariant auto|on|off``, ``--quantized auto|on|off``,
    ``--kv-cache-dtype int8``, ``--expert-cache SIZE`` with ``--expert-cache-policy``, and
    ``--threads N`` (shared with ``pipeline serve``)."""
    parser.add_argument("--threads", type=thread_count, default=None, metavar="N",
                        help="CPU threads for the model's products (default: torch's count, "
                             "with each decode step run on one thread instead when that is "
                             "faster lately, as on a machine whose other cores are busy)")
    parser.add_argument("--batch-invariant", choices=tuple(INVARIANCE), default="auto",
                        help="results independent of the batch and of prompt chunking (auto: "
                             "on for CPU; off is faster for one request decoding alone)")
    parser.add_argument("--quantized", choices=tuple(INVARIANCE), default="auto",
                        help="keep a GGUF file's weights quantized in memory (auto: on for "
                             "CPU at float32; off dequantizes to the compute dtype: the "
                             "reference numerics, five times the memory)")
    parser.add_argument("--kv-cache-dtype", choices=("int8",), default=None,
                        help="keep the KV cache in int8 with a scale per position and head "
                             "(about 3.8 times the context in the same memory; default: the "
                             "compute dtype)")
    parser.add_argument("--expert-cache", type=byte_size, default=None, metavar="SIZE",
                        help="memory cap for an MoE model's routed experts, e.g. 2GiB or "
                             "512MiB: the rest are read from the weight file when routed to "
                             "(same output, slower; default: every expert in memory)")
    parser.add_argument("--expert-cache-policy", choices=("lfu", "lru"), default="lfu",
                        help="which resident expert a miss evicts: the least often (lfu, "
                             "default) or least recently (lru) routed")


def thread_count(text: str) -> int:
    """``"2"`` -> 2 (an argparse type: anything but a whole number 1..1024 is a usage error
    naming it)."""
    if not text.strip().isdigit() or not 1 <= int(text) <= 1024:
        raise argparse.ArgumentTypeError(f"{text!r} is not a thread count (a whole number "
                                         "1..1024)")
    return int(text)


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30}


def byte_size(text: str) -> int:
    """``"512MiB"``, ``"2GB"``, ``"1048576"`` → bytes (an argparse type: a bad size is a usage
    error naming it)."""
    import re

    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = _UNITS.get(match.group(2).upper()) if match else None
    if match is None or unit is None or float(match.group(1)) * unit < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 512MiB, 2GiB, 4GB or "
                                         "a number of bytes)")
    return int(float(match.group(1)) * unit)


def backend_options(args: argparse.Namespace, **fields: Any) -> BackendOptions:
    """The build's :class:`~pipeline.options.BackendOptions`: one slot, the ``--device``,
    ``--dtype``, ``--quantized`` and ``--batch-invariant`` flags, and ``fields``; a bad value
    is an error before anything loads."""
    from pipeline.options import BackendOptions

    return BackendOptions(num_slots=1, device=args.device, dtype=args.dtype,
                          quantized=INVARIANCE[args.quantized],
                          batch_invariant=INVARIANCE[args.batch_invariant],
                          kv_cache_dtype=getattr(args, "kv_cache_dtype", None),
                          expert_cache_bytes=getattr(args, "expert_cache", None),
                          expert_cache_policy=getattr(args, "expert_cache_policy", "lfu"),
                          threads=getattr(args, "threads", None), **fields)


def sampling_params(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`~pipeline.contracts.request.GenerationConfig` fields the flags set (a field left out
    is the pipeline's default, ``max_tokens`` too, so the ready line tells the truth)."""
    params: dict[str, Any] = {field: getattr(args, field) for _, field, _, _ in _SAMPLING
                              if getattr(args, field) is not None}
    if args.stop:
        params["stop"] = args.stop
    return params


def given_flags(args: argparse.Namespace) -> dict[str, tuple[Any, str]]:
    """Each field a sampling flag set → (its value, the flag), for the ready line."""
    return {field: (getattr(args, field), flag) for flag, field, _, _ in _SAMPLING
            if getattr(args, field) is not None}


def _messages(args: argparse.Namespace) -> list[dict[str, str]]:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise InvalidValueError("prompt", prompt, "is empty: give a prompt or pipe one in")
    messages = [{"role": "system", "content": args.system}] if args.system else []
    return messages + [{"role": "user", "content": prompt}]


def _schema(value: str | None) -> Any:
    """``--json-schema``: the schema itself when it parses as JSON, else a file of one."""
    if value is None:
        return None
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        pass
    try:
        text = Path(value).read_text(encoding="utf-8")
    except OSError as e:
        raise InvalidValueError("--json-schema", value,
                                f"is neither JSON nor a readable file ({e.strerror})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidValueError("--json-schema", value, f"the file is not JSON: {e}") from None


def _run(args: argparse.Namespace) -> int:
    from pipeline.contracts.request import from_mapping

    choice = strategy_choice(args)
    level = recording(args)
    window = tap_window(args)
    messages = _messages(args)
    params = sampling_params(args)
    from_mapping(GenerationConfig, params)  # a bad flag is one line now, not after the load
    start = Loading(sys.stderr, args.model)  # a model that is nowhere: one line, not two
    with start.loading():  # the line shows now, before torch is imported
        from pipeline.process_memory import bound_native_caches
        from pipeline.events import JsonlSink

        bound_native_caches()  # the process is ours: a load's scratch goes back to the system
        options = backend_options(args)
        sinks = [JsonlSink(args.trace)] if args.trace is not None else []
        pipe = build_with(args.model, choice, sinks=sinks, options=options,
                          backend=args.backend)
    with pipe:
        start.ready(pipe, given_flags(args))
        handle = pipe.submit(messages, json_schema=_schema(args.json_schema), recording=level,
                             tap_tensors=window, **params)
        try:
            for delta in handle.deltas():
                if not args.json:
                    sys.stdout.write(delta.text)
                    sys.stdout.flush()
        except BaseException:
            handle.cancel()
            raise
        done = handle.result()
    if args.json:
        print(json.dumps({
            "request_id": done.request_id, "text": done.text,
            "finish_reason": done.finish_reason.value,
            "usage": {"prompt_tokens": done.usage.prompt_tokens,
                      "completion_tokens": done.usage.completion_tokens},
            "timings": {"queued_s": done.timings.queued_s,
                        "first_token_s": done.timings.first_token_s,
                        "total_s": done.timings.total_s}}, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
    _report(args, done, pipe)
    return 0


def _report(args: argparse.Namespace, done: Completion, pipe: Pipeline) -> None:
    """The run's figures on standard error: every one with ``--verbose`` (with the threads
    the decode steps used, and why), else one line when the answer went to a terminal."""
    figures = Figures.of(done)
    if args.verbose:
        lines = verbose_lines(figures)
        report = getattr(pipe.engine.backend if pipe.engine else None, "threads_report", None)
        said = report() if callable(report) else None
        if isinstance(said, str):
            lines.append(f"threads = {said}")
    elif sys.stdout.isatty() and not args.json:
        lines = [summary_line(figures)]
    else:
        return
    sys.stderr.write("".join(line + "\n" for line in lines))
    sys.stderr.flush()
