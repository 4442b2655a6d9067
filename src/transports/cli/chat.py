"""The ``pipeline chat`` command: a conversation at the terminal, as ``ollama run`` and
``llama-cli -cnv`` hold one (docs/design.md §14).

Owns the read-answer loop and its slash commands. Each line typed is a user turn: the whole
conversation so far (system prompt, earlier turns, this line) goes through the model's chat
template and the answer streams to standard output. ``--model``, ``--system``, the
sampling flags, ``--device``, ``--dtype``, ``--trace`` with ``--record`` (each turn's trace
appended) and the strategy flags (``--strategy``, ``--steps``, ``--block-length``,
``--strategy-option``) are ``pipeline run``'s.

- ``/reset`` forgets the turns (the system prompt stays); ``/system TEXT`` sets or replaces
  the system prompt (alone: shows it); ``/save FILE`` writes the conversation as JSON, a list
  of ``{"role", "content"}`` messages that ``build().generate`` and the OpenAI API accept;
  ``/help``; ``/exit`` (or ``/quit``, ``/bye``, or end of input) ends. ``//text`` sends
  ``/text``.
- Ctrl-C while an answer streams cancels that generation (the engine frees its slot) and
  returns to the prompt. What was shown of the answer stays in the conversation, since the
  user read it; an answer stopped before it showed anything is dropped with its question.
  Ctrl-C at the prompt clears a typed line; at an empty prompt it asks for a second one (or
  Ctrl-D), which ends the session.
- A conversation that no longer fits the model's window is refused with one line that says
  so and suggests ``/reset``; so is one whose answer filled the window.
- Standard error first says what loads and, once it is ready, the sampling defaults in
  effect and their source (:mod:`transports.cli.start`); then, on a terminal, the banner says
  what is loaded and that ``/help`` lists the commands.
- On a terminal there is a ``>>>`` prompt with line editing and a banner; with standard
  input from a pipe there is no decoration at all: each line read is one turn, each answer
  is one block of output ending in a newline, notes go to standard error.

Example::

    pipeline chat --model tiny --system "Be brief." --temperature 0
    printf 'Hi\\n/save chat.json\\n' | pipeline chat --model tiny
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transports.cli.run import (
    add_backend, add_record, add_sampling, backend_options, given_flags, recording, tap_window,
    sampling_params,
)
from transports.cli.start import DEFAULT_NAME, Loading
from transports.cli.strategy import add_strategy, build_with, strategy_choice
from pipeline.errors import ArtifactError, PipelineError
from pipeline.contracts.output import Completion, FinishReason
from pipeline.contracts.request import GenerationConfig, from_mapping

if TYPE_CHECKING:  # importing them imports torch: the command line loads that only when used
    from pipeline.engine.handle import RequestHandle
    from pipeline.pipe import Pipeline

Message = dict[str, str]
PROMPT = ">>> "
EXITS = ("/exit", "/quit", "/bye")
HELP = """\
/reset         forget the conversation (the system prompt stays)
/system TEXT   set or replace the system prompt; /system alone shows it
/save FILE     write the conversation as JSON: a list of {"role", "content"} messages
/help          this list (also /?)
/exit          end the session (also /quit, /bye, Ctrl-D)
//TEXT         send a message that starts with /
Ctrl-C stops an answer (what it said so far stays); at an empty prompt, twice ends."""


def add_parser(sub: Any) -> None:
    """The ``chat`` subcommand."""
    chat = sub.add_parser("chat", help="hold a conversation at the terminal (/help inside)",
                          description="Each line typed is a turn: the whole conversation "
                                      "goes to the model and the answer streams. The "
                                      "session's commands are listed below the options.",
                          epilog=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    chat.add_argument("--model", default=None,
                      help="a model folder, GGUF file, name (smollm2, tiny) or cached repo id "
                           "(default: SmolLM2-135M-Instruct)")
    chat.add_argument("--system", default=None, help="the system prompt to start with")
    add_sampling(chat)
    add_backend(chat)
    add_strategy(chat)
    chat.add_argument("--max-context", type=int, default=None, metavar="N",
                      help="cap the model's window at N tokens")
    chat.add_argument("--trace", type=Path, default=None, metavar="FILE",
                      help="append each turn's trace as JSONL to FILE")
    add_record(chat)
    chat.set_defaults(run=_chat)


def _chat(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    from_mapping(GenerationConfig, params)  # a bad flag is one line now, not at the 1st turn
    level = recording(args)
    if level is not None:
        params["recording"] = level
    window = tap_window(args)
    if window is not None:
        params["tap_tensors"] = window
    choice = strategy_choice(args)
    start = Loading(sys.stderr, args.model)
    with start.loading():  # the line shows now, before torch is imported
        from pipeline.process_memory import bound_native_caches
        from pipeline.events import JsonlSink

        bound_native_caches()  # the process is ours: a load's scratch goes back to the system
        options = backend_options(args, max_context=args.max_context)
        sinks = [JsonlSink(args.trace)] if args.trace is not None else []
        pipe = build_with(args.model, choice, sinks=sinks, options=options,
                          backend=args.backend)
    terminal = Terminal(sys.stdin.isatty() and sys.stdout.isatty())
    with pipe:
        session = Session(pipe, Conversation(args.system or None), params, terminal)
        start.ready(pipe, given_flags(args))
        terminal.banner(args.model or DEFAULT_NAME, pipe, session.window)
        return session.run()


class Conversation:
    """The system prompt (kept apart: ``/reset`` keeps it) and the turns so far."""

    def __init__(self, system: str | None = None) -> None:
        self.system = system
        self.turns: list[Message] = []

    def messages(self, *more: Message) -> list[Message]:
        """The whole conversation as chat messages, ``more`` appended."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns + list(more)

    def save(self, path: Path) -> int:
        """Write :meth:`messages` as a JSON list; returns how many were written."""
        messages = self.messages()
        path.write_text(json.dumps(messages, ensure_ascii=False, indent=2) + "\n",
                        encoding="utf-8")
        return len(messages)


class Terminal:
    """Where lines come from and text goes: a terminal (prompt, line editing, banner) or
    pipes (bare lines in, answers on standard output, notes on standard error)."""

    def __init__(self, interactive: bool) -> None:
        self.interactive = interactive
        self._typed = False
        self._readline: Any = None
        if interactive:
            try:
                import readline  # line editing and history for input()
            except ImportError:  # pragma: no cover - platforms without it
                pass
            else:
                self._readline = readline

    def read(self) -> str | None:
        """The next line without its newline; ``None`` at the end of input."""
        self._typed = False
        if self.interactive:
            previous = signal.signal(signal.SIGINT, self._interrupted)
            try:
                return input(PROMPT)
            except EOFError:
                self.write("\n")
                return None
            finally:
                signal.signal(signal.SIGINT, previous)
        line = sys.stdin.readline()
        return line.rstrip("\r\n") if line else None

    def typed(self) -> bool:
        """Whether the line being edited held text when Ctrl-C interrupted :meth:`read`."""
        return self._typed

    def _interrupted(self, signum: int, frame: Any) -> None:
        # readline runs this handler before it discards the line it was editing
        self._typed = bool(self._readline is not None and self._readline.get_line_buffer())
        raise KeyboardInterrupt

    def write(self, text: str) -> None:
        """Answer text, shown at once."""
        sys.stdout.write(text)
        sys.stdout.flush()

    def show(self, text: str) -> None:
        """What a command was asked to show (standard output)."""
        self.write(text + "\n")

    def note(self, text: str) -> None:
        """A remark about the session, one line on standard error."""
        sys.stdout.flush()
        print(text, file=sys.stderr, flush=True)

    def banner(self, model: str, pipe: Pipeline, window: int) -> None:
        """Once the model is ready, on a terminal: what is loaded and how to get help."""
        if not self.interactive:
            return
        info = pipe.model_info()
        what = f"{info.summary()}, " if info else ""
        strategy = pipe.description.get("strategy")
        how = f", strategy {strategy}" if strategy else ""
        self.note(f"pipeline chat: {model} ({what}window {window} tokens{how}). "
                  "/help for commands, Ctrl-D to end.")


class Session:
    """The loop: read a line, run a command or answer it, until the user ends it."""

    def __init__(self, pipe: Pipeline, conversation: Conversation, params: dict[str, Any],
                 terminal: Terminal) -> None:
        if pipe.engine is None:
            raise ArtifactError("this model folder has no weights (only a tokenizer): chat "
                                "needs a model that generates")
        self.pipe = pipe
        self.conversation = conversation
        self.params = params
        self.terminal = terminal
        self.window = pipe.engine.backend.max_context

    def run(self) -> int:
        """Turns until ``/exit``, the end of input, or Ctrl-C twice at an empty prompt."""
        strikes = 0
        while True:
            try:
                line = self.terminal.read()
            except KeyboardInterrupt:
                typed = self.terminal.typed()
                self.terminal.write("\n" if self.terminal.interactive else "")
                strikes = 0 if typed else strikes + 1
                if strikes >= 2:
                    return 0
                if strikes:
                    self.terminal.note("(Ctrl-C again or Ctrl-D to end the session)")
                continue
            strikes = 0
            if line is None:
                return 0
            try:
                if not self.handle(line):
                    return 0
            except KeyboardInterrupt:  # in a command, or while a prompt was counted
                self.terminal.write("\n")
                self.terminal.note("[stopped]")

    def handle(self, line: str) -> bool:
        """Act on one line; False ends the session."""
        text = line.strip()
        if not text:
            return True
        if text.startswith("/") and not text.startswith("//"):
            return self.command(text)
        self.turn(text[1:] if text.startswith("//") else text)
        return True

    def command(self, text: str) -> bool:
        """Run a slash command; False ends the session."""
        name, _, rest = text.partition(" ")
        rest = rest.strip()
        note, conversation = self.terminal.note, self.conversation
        if name in EXITS:
            return False
        if name in ("/help", "/?"):
            self.terminal.show(HELP)
        elif name == "/reset":
            conversation.turns.clear()
            note("conversation cleared" + (" (the system prompt stays)"
                                           if conversation.system else ""))
        elif name == "/system":
            if rest:
                conversation.system = rest
                note("system prompt set")
            else:
                self.terminal.show(conversation.system or "(no system prompt)")
        elif name == "/save":
            self._save(rest)
        else:
            note(f"unknown command {name}: /help lists the commands")
        return True

    def _save(self, where: str) -> None:
        if not where:
            self.terminal.note("/save needs a file name: /save chat.json")
            return
        path = Path(where).expanduser()
        try:
            count = self.conversation.save(path)
        except OSError as exc:
            self.terminal.note(f"could not save to {path}: {exc.strerror or exc}")
            return
        self.terminal.note(f"saved {count} message{'s' * (count != 1)} to {path}")

    def turn(self, text: str) -> None:
        """Answer ``text`` with the whole conversation as context, streaming."""
        question = {"role": "user", "content": text}
        messages = self.conversation.messages(question)
        try:
            size = self.pipe.count_tokens(messages)
            if size >= self.window:
                self.terminal.note(
                    f"the conversation is {size} tokens and the model's window {self.window}: "
                    "it no longer fits; /reset starts over (or send less)")
                return
            shown, completion = self._stream(messages)
        except PipelineError as exc:
            self.terminal.note(f"pipeline chat: {exc}")
            return
        stopped = completion.finish_reason is FinishReason.CANCELLED
        if stopped and not shown:
            self.terminal.note("[stopped before the answer began; dropped]")
            return
        self.conversation.turns += [question, {"role": "assistant", "content": shown}]
        if stopped:
            self.terminal.note("[stopped]")
        elif self._filled(completion.finish_reason, completion.usage.total_tokens):
            self.terminal.note(f"[the answer filled the model's window of {self.window} "
                               "tokens: /reset starts over]")

    def _stream(self, messages: list[Message]) -> tuple[str, Completion]:
        """Stream an answer: the text shown and the completion.

        Ctrl-C meanwhile cancels the request instead of raising: the engine ends it at its
        next step with a final delta, so the loop below ends the ordinary way and what was
        shown is exactly what was appended (an exception could land between the two).
        """
        shown: list[str] = []
        handle: RequestHandle | None = None
        stopping = False

        def interrupt(signum: int, frame: Any) -> None:
            nonlocal stopping
            stopping = True
            if handle is not None:
                handle.cancel()

        previous = signal.signal(signal.SIGINT, interrupt)
        try:
            handle = self.pipe.submit(messages, **self.params)
            if stopping:  # Ctrl-C while the prompt was prepared
                handle.cancel()
            for delta in handle.deltas():
                shown.append(delta.text)
                self.terminal.write(delta.text)
            completion = handle.result()
        except BaseException:
            if handle is not None:
                handle.cancel()
            raise
        finally:
            signal.signal(signal.SIGINT, previous)
        self.terminal.write("\n\n" if self.terminal.interactive and shown else "\n")
        return "".join(shown), completion

    def _filled(self, reason: FinishReason, total_tokens: int) -> bool:
        return reason is FinishReason.LENGTH and total_tokens >= self.window
