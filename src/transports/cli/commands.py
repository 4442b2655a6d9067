"""The ``pipeline`` command: ``run``, ``chat``, ``count``, ``demo``, ``plugins``, ``trace``,
``serve``.

Owns argument parsing and printing only; every command calls the library's public API. Every
error a user can cause is one line on standard error that says what to do, with a non-zero
exit status, never a traceback; a closed pipe (``pipeline run ... | head``) ends quietly.
Usage errors too (:class:`Parser`): an unknown option of any command is named with the
closest one (``unknown option --temprature; did you mean --temperature?``), a bad value with
its flag, each one line and exit status 2. ``serve --port`` is 0 to 65535 (0: any free port,
the log says which). ``count``'s text, like ``run``'s prompt, is standard input when it is
``-`` or absent.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import attrs

from transports.cli.chat import add_parser as add_chat_parser
from transports.cli.compare import add_parser as add_compare_parser
from transports.cli.start import Figures
from transports.cli.run import INVARIANCE, add_invariance
from transports.cli.run import add_parser as add_run_parser
from transports.cli.strategy import add_strategy
from pipeline.trace.commands import add_parser as add_trace_parser


def command() -> str:
    """How the user can run this command again from where they are: ``pipeline`` when that
    name finds this very program, else its path (``.venv/bin/pipeline``, for a hint printed
    by ``make demo`` in a shell whose virtual environment is not active), or
    ``PYTHON -m pipeline`` when it was started that way."""
    program = Path(sys.argv[0])
    if program.name != "pipeline":  # python -m pipeline
        return f"{_shown(Path(sys.executable))} -m pipeline"
    found = shutil.which("pipeline")
    if found is not None and Path(found).resolve() == program.resolve():
        return "pipeline"
    return _shown(program)


def _shown(path: Path) -> str:
    """``path`` relative to the working folder when it lies under it, else absolute (links
    kept: a virtual environment's ``python`` is a link that must not be followed)."""
    absolute = os.path.abspath(path)
    relative = os.path.relpath(absolute)
    if relative.startswith(".."):
        return absolute
    return relative if os.sep in relative else f".{os.sep}{relative}"


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line on standard error (exit status 2):
    the command, what is wrong and what to do, never the usage block. Arguments left over
    are refused by the innermost command that saw them, so an unknown option is named with
    that command's closest option. ``add_subparsers`` makes its commands of this class."""

    def error(self, message: str) -> NoReturn:
        """Exit with ``message`` as one line."""
        self.exit(2, f"{self.prog}: {message} (`{self.prog} --help` lists the options)\n")

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        """argparse's, but what this parser cannot place is an error here and now."""
        parsed, extra = super().parse_known_args(args, namespace)
        if extra:
            self.exit(2, f"{self.prog}: {self.unknown(extra)}\n")
        return parsed, extra

    def unknown(self, extra: Sequence[str]) -> str:
        """What is wrong with the arguments ``extra`` this parser could not place."""
        option = next((a.split("=", 1)[0] for a in extra if a.startswith("-") and a != "-"),
                      None)
        if option is None:
            return (f"unexpected argument {' '.join(extra)!r} (quote a prompt or text of "
                    f"several words; `{self.prog} --help` lists the arguments)")
        from pipeline.errors import closest

        known = [flag for action in self._actions for flag in action.option_strings
                 if flag.startswith("--")]
        near = closest(option, known)
        hint = (f"did you mean {near}?" if near is not None
                else f"`{self.prog} --help` lists the options")
        return f"unknown option {option}; {hint}"


PORTS = range(0, 65536)
"""TCP ports ``serve --port`` takes; 0 asks the system for any free one."""


def port(text: str) -> int:
    """``--port``'s value (an argparse type): 0 to 65535, else a usage error naming it."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value not in PORTS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port: give 0 to 65535, or "
                                         "0 for any free one")
    return value


def _plugins(args: argparse.Namespace) -> int:
    from pipeline.registry import Registry

    registry = Registry()
    rows = sorted(registry.components(), key=lambda c: (c.kind, c.name))
    width = max((len(c.name) for c in rows), default=4)
    kind = ""
    for comp in rows:
        if comp.kind != kind:
            kind = comp.kind
            print(f"{kind}:")
        print(f"  {comp.name:<{width}}  {comp.summary}  [{comp.plugin}]")
    return 0


def _count(args: argparse.Namespace) -> int:
    """Count through the model's own tokenizer and chat template, never its weights (nor
    torch: :mod:`pipeline.tokenizing`)."""
    from pipeline.tokenizing import count_tokens, load_tokenizer

    text = sys.stdin.read() if args.text == "-" else args.text  # as `run -` reads its prompt
    tokenizer, renderer = load_tokenizer(args.model)
    print(len(tokenizer.encode_text(text)) if args.raw
          else count_tokens(tokenizer, renderer, text))
    return 0


def _demo(args: argparse.Namespace) -> int:
    """Echo the question, stream the default model's answer, print a run summary and the
    command that shows the kept trace."""
    from pipeline.builder import build
    from pipeline.events import JsonlSink

    print(f"> {args.question}")
    sinks = []
    if args.trace is not None:
        args.trace.parent.mkdir(parents=True, exist_ok=True)
        args.trace.unlink(missing_ok=True)  # one run's trace, not an ever-growing file
        sinks.append(JsonlSink(args.trace))
    with build(args.model, sinks=sinks, options={"num_slots": 1}) as pipe:
        handle = pipe.submit(args.question, max_tokens=args.max_tokens, temperature=0.0)
        for delta in handle.deltas():
            sys.stdout.write(delta.text)
            sys.stdout.flush()
        done = handle.result()
    print()
    figures = Figures.of(done)  # as `pipeline run` reports them: decode speed after ttft
    print(f"ttft {(figures.ttft_s or 0.0) * 1e3:.1f} ms | {figures.decode_rate or 0.0:.0f} "
          f"tokens/s | finish {figures.finish} | {len(done.trace)} trace events")
    if args.trace is not None:
        print(f"trace: {args.trace} (show it with: {command()} trace show {args.trace})")
    return 0


def _serve(args: argparse.Namespace) -> int:
    """Serve models over HTTP (OpenAI and Anthropic dialects) until interrupted."""
    from pipeline.process_memory import bound_native_caches
    from transports.cli.strategy import check_strategies, registered_strategies, served_choices
    from pipeline.errors import PipelineError
    from transports.http import ServerConfig, load_api_keys, parse_models, serve
    from transports.http.accounting import logs
    from transports.http.server.limits import Limits
    from transports.http.server.timeouts import Timeouts

    bound_native_caches()  # a long-running process: memory must not grow with traffic's variety
    try:
        keys = load_api_keys(args.api_key_env, args.api_key_file)
        limits = Limits(**{f.name: getattr(args, f.name) for f in attrs.fields(Limits)})
        models = parse_models(args.model)
        strategies = served_choices(args, models)
        check_strategies(strategies.values(), registered_strategies())
        config = ServerConfig(
            models=models, strategies=strategies, api_keys=keys, data_dir=args.data_dir,
            num_slots=args.slots, max_queue=args.max_queue, max_context=args.max_context,
            context_slack=args.context_slack, clamp_max_tokens=not args.no_clamp,
            reasoning_budget_tokens=args.reasoning_budget,
            answer_reserve_tokens=args.answer_reserve, limits=limits,
            work_threads=args.work_threads, work_queue=args.work_queue,
            restart_delay_s=args.restart_delay, keep_traces=args.keep_traces,
            engine_process=args.engine_process, ranks=args.ranks,
            usage_database=args.usage_db,
            stall_timeout_s=args.stall_timeout or None, usage_wait_s=args.usage_wait,
            request_deadline_s=args.request_deadline,
            max_queue_wait_s=args.max_queue_wait or None,
            timeouts=Timeouts(args.header_timeout, args.body_timeout),
            device=args.device, dtype=args.dtype, quantized=INVARIANCE[args.quantized],
            kv_cache_dtype=args.kv_cache_dtype, expert_cache_bytes=args.expert_cache,
            expert_cache_policy=args.expert_cache_policy,
            batch_invariant=INVARIANCE[args.batch_invariant], threads=args.threads,
            backend=args.backend)
        config.backend_options().check_device()
    except PipelineError as exc:
        print(f"pipeline serve: {exc}", file=sys.stderr)
        return 2
    from backends.torch.parallel import launched_world

    place = launched_world()
    if place is not None:  # torchrun: one model split over the ranks; rank 0 serves it
        if len(models) != 1 or args.engine_process or args.ranks > 1:
            print("pipeline serve: under torchrun the ranks hold one model together: serve "
                  "one --model, without --engine-process or --ranks (--ranks N starts and "
                  "supervises a group itself, without torchrun)", file=sys.stderr)
            return 2
        if place[0] > 0:  # this rank's part of the model, no HTTP: it ends with rank 0
            from transports.http.gateway.loading import default_builder

            name, folder = next(iter(models.items()))
            default_builder(folder, config, config.strategy(name))
            return 0
    if not keys and not _loopback(args.host) and not args.insecure:
        print(f"pipeline serve: refusing to serve {args.host} without API keys: set "
              f"${args.api_key_env} or --api-key-file, or pass --insecure", file=sys.stderr)
        return 2
    logs.configure(args.log_level.upper())
    if not keys:
        logs.log.warning("no API keys are configured: anyone who can reach %s can use this "
                         "server", args.host)
    serve(config, args.host, args.port)
    return 0


def _loopback(host: str) -> bool:
    """True for a host name or address that only this machine can reach."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _add_limits(serve: Any) -> None:
    """One flag per request limit (``--max-body-bytes`` ...), defaults from :class:`Limits`."""
    from transports.http.server.limits import Limits

    group = serve.add_argument_group("request limits (a request over one is refused, 4xx)")
    for field in attrs.fields(Limits):
        group.add_argument(f"--{field.name.replace('_', '-')}", dest=field.name, type=int,
                           default=field.default, metavar="N",
                           help=f"{field.metadata['help']} (default {field.default})")


def _add_serve(sub: Any, limits: bool = True) -> None:
    serve = sub.add_parser("serve", help="serve models over HTTP (OpenAI + Anthropic dialects)")
    serve.add_argument("--model", action="append", default=[],
                       help="MODEL or NAME=MODEL, repeatable; MODEL is a folder, GGUF file, "
                            "name or cached repo id (default: SmolLM2-135M-Instruct)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1, this machine only)")
    serve.add_argument("--port", type=port, default=8000,
                       help="TCP port, 0 to 65535 (default 8000; 0 picks a free one, which "
                            "the log names)")
    serve.add_argument("--data-dir", default="pipeline-data", help="where the usage store lives")
    serve.add_argument("--api-key-env", default="PIPELINE_API_KEYS",
                       help="environment variable holding comma-separated API keys")
    serve.add_argument("--api-key-file", default=None, help="file with one API key per line")
    serve.add_argument("--slots", type=int, default=8, help="concurrent requests per model")
    serve.add_argument("--max-queue", type=int, default=64, help="waiting requests per model")
    serve.add_argument("--max-context", type=int, default=None, help="cap on the window")
    serve.add_argument("--context-slack", type=int, default=0, metavar="N",
                       help="tokens of each window kept free (default 0)")
    serve.add_argument("--no-clamp", action="store_true",
                       help="refuse a max_tokens beyond the room instead of clamping it")
    serve.add_argument("--reasoning-budget", type=int, default=None,
                       help="default reasoning budget in tokens")
    serve.add_argument("--answer-reserve", type=int, default=4096, metavar="N",
                       help="a request that states no thinking preference keeps min(N, "
                            "max_tokens/3) tokens for its answer (default 4096)")
    serve.add_argument("--work-threads", type=int, default=4,
                       help="threads that parse, render and count requests")
    serve.add_argument("--work-queue", type=int, default=64,
                       help="requests that may wait for those threads before a 429")
    serve.add_argument("--restart-delay", type=float, default=1.0, metavar="SECONDS",
                       help="wait before a stopped engine is replaced by a fresh one")
    serve.add_argument("--usage-db", default=None, metavar="URL",
                       help="a postgresql:// URL: usage records go to that database (one that "
                            "replicas share) instead of SQLite in --data-dir")
    serve.add_argument("--engine-process", action="store_true",
                       help="run each model's engine in a child process the server watches: "
                            "a crash, an out-of-memory kill or a stall ends that process "
                            "(its requests fail, a fresh one starts), not the server")
    serve.add_argument("--ranks", type=int, default=1, metavar="N",
                       help="split the model over N processes that the server starts and "
                            "supervises as one group (gloo on CPUs, one GPU a rank with "
                            "--device cuda): a lost rank fails its requests retryably and a "
                            "whole fresh group replaces it; implies --engine-process")
    serve.add_argument("--stall-timeout", type=float, default=120.0, metavar="SECONDS",
                       help="an engine step running longer is a stall: its requests fail "
                            "with a 503 and the engine is replaced (0: never checked)")
    serve.add_argument("--request-deadline", type=float, default=None, metavar="SECONDS",
                       help="end a request that has run this long since it was accepted "
                            "(queueing included) with what it wrote so far")
    serve.add_argument("--max-queue-wait", type=float, default=60.0, metavar="SECONDS",
                       help="a request that waits this long in its model's queue without a "
                            "slot gets the overload error (OpenAI 503, Anthropic 529; "
                            "default 60, 0: no bound)")
    serve.add_argument("--usage-wait", type=float, default=5.0, metavar="SECONDS",
                       help="the longest a response waits for its usage record to be "
                            "durable (a record not yet written is kept and retried)")
    serve.add_argument("--keep-traces", type=int, default=100, metavar="N",
                       help="keep the last N requests' traces in memory for GET "
                            "/traces/{request_id} (0: none)")
    serve.add_argument("--device", default="cpu",
                       help="torch device of the models (cpu, cuda, cuda:N, mps)")
    serve.add_argument("--dtype", default=None,
                       help="compute dtype (float32, bfloat16, float16; default: the model's)")
    serve.add_argument("--backend", default=None, metavar="NAME",
                       help="the models' backend: torch (a folder's default), gguf (a GGUF "
                            "file's), transformers (any causal LM transformers loads)")
    add_invariance(serve)
    serve.add_argument("--log-level", default="info",
                       choices=("info", "warning", "error"),
                       help="least severe log line written to standard error; info has the "
                            "models, the address and one line per request (default info)")
    serve.add_argument("--insecure", action="store_true",
                       help="serve a non-loopback address without API keys")
    serve.add_argument("--header-timeout", type=float, default=10.0, metavar="SECONDS",
                       help="time a request's headers may take to arrive (then 408, close)")
    serve.add_argument("--body-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="time a request's body may take to arrive (then 408, close)")
    add_strategy(serve, per_model=True)
    if limits:  # their table lives in the HTTP transport, whose import brings torch
        _add_limits(serve)
    serve.set_defaults(run=_serve)


HELP = """\
Run a language model on this machine, as an explicit pipeline you can inspect.
With no --model, the commands use SmolLM2-135M-Instruct, a small model that runs on any CPU.

examples:
  pipeline run "Why is the sky blue?"          answer one question (or pipe text in)
  pipeline chat                                talk to the model; /help inside
  pipeline serve --port 8000                   OpenAI- and Anthropic-compatible server and a
                                               chat page at http://127.0.0.1:8000/
  pipeline count "hello world"                 count tokens exactly, as the model sees them
  pipeline run --trace t.jsonl --record full "hi"; pipeline trace show t.jsonl
                                               see each step of a run, token by token
  pipeline compare --a dtype=float32 --b dtype=bfloat16 "What is 2+2?"
                                               where two configurations part, to the layer

'pipeline COMMAND --help' lists a command's options. Documentation: docs/quickstart.md."""
"""What ``pipeline --help`` says above the command list: what the tool is for, written for
someone who has just installed it (the module docstring is for maintainers)."""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pipeline`` console script."""
    from pipeline import __version__

    parser = Parser(prog="pipeline", description=HELP,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"pipeline {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_run_parser(sub)
    add_chat_parser(sub)
    sub.add_parser("plugins", help="list registered components").set_defaults(run=_plugins)
    count = sub.add_parser("count", help="count the tokens of a user message exactly "
                                         "(through the chat template; --raw: the text alone)")
    count.add_argument("--model", "--tokenizer", dest="model", default=None,
                       help="a model or tokenizer folder, GGUF file, name or cached repo id "
                            "(default: SmolLM2-135M-Instruct)")
    count.add_argument("--raw", action="store_true",
                       help="count the text's own tokens, without the chat template")
    count.add_argument("text", nargs="?", default="-",
                       help="the text to count (a user message, or raw with --raw; default "
                            "or '-': read standard input, all of it, as `run -` reads a "
                            "prompt)")
    count.set_defaults(run=_count)
    demo = sub.add_parser("demo", help="stream an answer and print a run summary")
    demo.add_argument("--model", default=None,
                      help="a model folder, GGUF file, name (smollm2, tiny) or cached repo id "
                           "(default: SmolLM2-135M-Instruct)")
    demo.add_argument("--question", default="Why is the sky usually blue? Answer in one sentence.",
                      help="the question to ask the default model")
    demo.add_argument("--max-tokens", type=int, default=80,
                      help="stop the answer after this many tokens (default 80)")
    demo.add_argument("--trace", type=Path, default=None, metavar="FILE",
                      help="keep the run's trace as JSONL in FILE")
    demo.set_defaults(run=_demo)
    add_trace_parser(sub)
    add_compare_parser(sub)
    _add_serve(sub, limits=_command(argv) not in QUICK_START)
    words = list(sys.argv[1:] if argv is None else argv)
    if not words:  # a bare `pipeline` asks what there is: the commands, not an error line
        parser.print_help(sys.stderr)
        return 2
    if _command(words) is None:  # `pipeline --verison`: name it, not the missing command
        known = {flag for action in parser._actions for flag in action.option_strings}
        unknown = [w for w in words if w.startswith("-")  # argparse takes a known prefix
                   and not any(k.startswith(w.split("=")[0]) for k in known)]
        if unknown:
            parser.exit(2, f"{parser.prog}: {parser.unknown(unknown)}\n")
    args = parser.parse_args(words)
    return _guarded(args)


QUICK_START = ("run", "chat")
"""The commands that write their loading line before the library loads torch: their
parser leaves out what would import it first (``serve``'s request-limit flags)."""


def _command(argv: Sequence[str] | None) -> str | None:
    """The command word of ``argv`` (None: the process's own arguments), if any."""
    words = sys.argv[1:] if argv is None else argv
    return next((w for w in words if not w.startswith("-")), None)


def _guarded(args: argparse.Namespace) -> int:
    """Run the command; turn what a user can cause into one line and an exit status."""
    from pipeline.errors import PipelineError

    try:
        return int(args.run(args))
    except PipelineError as exc:
        print(f"pipeline {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"pipeline {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader left (| head): say nothing, and keep Python from complaining at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
