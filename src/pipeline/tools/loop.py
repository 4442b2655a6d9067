"""The in-process tool loop: generate, let the calls cross the boundary, feed results back.

Owns :func:`run_tools` (what :meth:`pipeline.Pipeline.run` does) and its results,
:class:`ToolRun` and :class:`Round`. Each round is one generation over the conversation so
far with the tools rendered through the chat template; the calls the engine parsed from it
go through the :class:`~pipeline.tools.boundary.ToolBoundary` in order, their events joining
that generation's trace, and the results come back as ``tool`` messages. The loop ends when
the model answers without calling a tool, when ``max_rounds`` rounds of calls have run (the
calls of the answer after them are recorded as ``tool.skipped``, not executed), or on
cancel; ``ToolRun.stopped`` says which, and says ``length`` or ``malformed_call`` for an
answer that is not one (cut by ``max_tokens``, or a call the parser could not read). Each
round may have its own ``tool_choice`` (a list, one per round, the last repeating, or a
function of the round's number): ``["required", "none"]`` calls first, then answers. Idempotency keys derive from ``run_id``, the round, the call's place and its
content, so re-running a run with the same ``run_id`` and ledger never repeats an effect.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from pipeline.errors import ArtifactError, InvalidValueError
from pipeline.events import Event, EventSink, Tracer, digest_json
from pipeline.registry import BuildContext
from pipeline.tools.boundary import Ask, CallOutcome, ToolBoundary
from pipeline.tools.executor import AllowAll, FunctionTool, ToolExecutor, ToolPolicy
from pipeline.tools.ledger import JsonlLedger, Ledger, MemoryLedger
from pipeline.contracts.output import Completion, FinishReason, TextPiece
from pipeline.contracts.request import GenerationConfig, Message, ToolCall, ToolChoice, ToolSpec

if TYPE_CHECKING:
    from pipeline.pipe import Pipeline

Tool = ToolExecutor | Callable[..., Any] | str
"""What ``tools=`` accepts: an executor, a typed function, or a registered tool's name."""

OneChoice = ToolChoice | str | Mapping[str, Any] | None
RoundChoice = OneChoice | Sequence[OneChoice] | Callable[[int], OneChoice]
"""What ``tool_choice=`` of a run accepts: one choice for every round, a list (round ``i``
takes entry ``i``, the last repeating) or a function of the round's number."""


@attrs.frozen
class Round:
    """One generation and what became of the calls it made; ``trace`` is the generation's
    trace with the calls' boundary events after it."""

    completion: Completion
    outcomes: tuple[CallOutcome, ...]
    trace: tuple[Event, ...]


@attrs.frozen
class ToolRun:
    """What a tool loop did: the last completion, every round, the whole conversation, and
    why it stopped: ``answered`` (an answer with no call, ended by the model), ``length`` (an
    answer with no call, cut by ``max_tokens``), ``malformed_call`` (no call could be read, and
    the model wrote one that is not well formed), ``max_rounds`` or ``cancelled``."""

    completion: Completion
    rounds: tuple[Round, ...]
    messages: tuple[Message, ...]
    stopped: str
    boundary: ToolBoundary = attrs.field(eq=False, repr=False)
    sinks: tuple[EventSink, ...] = attrs.field(eq=False, repr=False)

    @property
    def calls(self) -> tuple[CallOutcome, ...]:
        """Every call of every round, in order."""
        return tuple(o for r in self.rounds for o in r.outcomes)

    @property
    def traces(self) -> tuple[tuple[Event, ...], ...]:
        """Each round's trace."""
        return tuple(r.trace for r in self.rounds)

    def compensate(self, call_id: str) -> tuple[Any, tuple[Event, ...]]:
        """Undo an executed call explicitly (its executor's ``compensate``): the result and
        the call's round trace with ``tool.compensated`` appended."""
        for r in self.rounds:
            for outcome in r.outcomes:
                if outcome.call.id == call_id and outcome.key is not None:
                    tracer = Tracer.resume(r.trace, self.sinks)
                    result = self.boundary.compensate(outcome.key, tracer)
                    return result, tracer.events
        raise InvalidValueError("call_id", call_id, "no call of this run has that id")


def run_tools(pipe: Pipeline, messages: str | Sequence[Message | Mapping[str, Any]], *,
              tools: Sequence[Tool], sinks: Sequence[EventSink], max_rounds: int = 4,
              policy: ToolPolicy | str | None = None, ask: Ask | None = None,
              ledger: Ledger | str | Path | None = None, run_id: str | None = None,
              cancel: threading.Event | None = None, config: GenerationConfig | None = None,
              tool_choice: RoundChoice = None, **options: Any) -> ToolRun:
    """Run the tool loop (see :meth:`pipeline.Pipeline.run`)."""
    if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or max_rounds < 0:
        raise InvalidValueError("max_rounds", max_rounds, "must be an integer >= 0")
    if pipe.stages.tool_parser is None:
        raise ArtifactError("this pipeline reads no tool calls (it has no chat template to "
                            "choose a parser from): build it with tool_parser=")
    executors = _executors(pipe, tools)
    boundary = ToolBoundary(executors, policy=_policy(pipe, policy), ledger=_ledger(ledger),
                            ask=ask, cancel=cancel)
    specs = [tool.spec for tool in executors.values()]
    choose = _per_round(tool_choice)
    if isinstance(tool_choice, (list, tuple)):   # every round's choice checked before any runs
        for i in range(len(tool_choice)):
            chosen = choose(i)
            if chosen.kind == "tool" and chosen.name not in executors:
                raise InvalidValueError(f"tool_choice[{i}]", chosen.name,
                                        "names no tool of this run")
    loop = _Loop(pipe, boundary, tuple(sinks), run_id or uuid.uuid4().hex, cancel, choose)
    conversation = ([Message("user", messages)] if isinstance(messages, str) else
                    [m if isinstance(m, Message) else Message.from_dict(m) for m in messages])
    return loop.run(conversation, specs, max_rounds, config, options)


def _per_round(choice: Any) -> Callable[[int], Any]:
    """``tool_choice`` as a function of the round's number (None: the request's default)."""
    if callable(choice):
        return choice   # type: ignore[no-any-return]
    if isinstance(choice, (list, tuple)):
        if not choice:
            raise InvalidValueError("tool_choice", [], "give at least one round's choice")
        rounds = [ToolChoice.coerce(c) for c in choice]   # checked before anything runs
        return lambda number: rounds[min(number, len(rounds) - 1)]
    fixed = None if choice is None else ToolChoice.coerce(choice)
    return lambda _: fixed


class _Loop:
    def __init__(self, pipe: Pipeline, boundary: ToolBoundary, sinks: tuple[EventSink, ...],
                 run_id: str, cancel: threading.Event | None,
                 choice: Callable[[int], Any]) -> None:
        self.pipe, self.boundary, self.sinks = pipe, boundary, sinks
        self.run_id, self.cancel, self.choice = run_id, cancel, choice

    def run(self, conversation: list[Message], specs: list[ToolSpec], max_rounds: int,
            config: GenerationConfig | None, options: dict[str, Any]) -> ToolRun:
        rounds: list[Round] = []
        stopped = "answered"
        for number in range(max_rounds + 1):
            choice = self.choice(number)
            completion = self._generate(conversation, specs, config,
                                        options if choice is None
                                        else {**options, "tool_choice": choice})
            tracer = Tracer.resume(completion.trace, self.sinks)
            calls = completion.tool_calls
            conversation.append(Message("assistant", self._answer(completion) or None, calls))
            if completion.finish_reason is FinishReason.CANCELLED:
                stopped = "cancelled"
                outcomes = self._skip(calls, tracer, "the request was cancelled")
            elif not calls:
                outcomes = ()
                stopped = _unanswered(completion) or stopped
            elif number == max_rounds:
                stopped = "max_rounds"
                outcomes = self._skip(calls, tracer, f"max_rounds={max_rounds} reached")
            else:
                outcomes = tuple(self.boundary.process(call, tracer, self._key(number, i, call))
                                 for i, call in enumerate(calls))
                conversation += [Message("tool", o.content, tool_call_id=o.call.id,
                                         name=o.call.name) for o in outcomes]
            rounds.append(Round(completion, outcomes, tracer.events))
            if not calls or stopped != "answered" or self._cancelled():
                stopped = "cancelled" if self._cancelled() else stopped
                break
        return ToolRun(rounds[-1].completion, tuple(rounds), tuple(conversation), stopped,
                       self.boundary, self.sinks)

    def _cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    def _generate(self, conversation: list[Message], specs: list[ToolSpec],
                  config: GenerationConfig | None, options: dict[str, Any]) -> Completion:
        handle = self.pipe.submit(conversation, config, tools=specs, **options)
        while True:
            try:
                return handle.result(timeout=None if self.cancel is None else 0.05)
            except TimeoutError:
                if self._cancelled():
                    handle.cancel()

    def _answer(self, completion: Completion) -> str:
        """The completion's text outside its tool calls."""
        parser = self.pipe.stages.tool_parser
        assert parser is not None
        reader = parser.start(completion.request_id)
        pieces = reader.feed(completion.text) + reader.finish()
        return "".join(p.text for p in pieces if isinstance(p, TextPiece)).strip()

    def _key(self, number: int, index: int, call: ToolCall) -> str:
        return digest_json({"run": self.run_id, "round": number, "index": index,
                            "name": call.name, "arguments": call.arguments})

    @staticmethod
    def _skip(calls: Sequence[ToolCall], tracer: Tracer, why: str) -> tuple[CallOutcome, ...]:
        parsed = {e.payload.get("call_id"): e.event_id for e in tracer.events
                  if e.event_type == "tool.parsed"}
        for call in calls:
            tracer.emit("tools", "tool.skipped", {"call_id": call.id, "name": call.name,
                                                  "reason": why}, parsed.get(call.id))
        return tuple(CallOutcome(call, None, "skipped", error=why) for call in calls)


def _unanswered(completion: Completion) -> str | None:
    """Why a completion with no call is no answer: ``malformed_call`` (the model wrote a call
    the parser could not read), ``length`` (cut by ``max_tokens``); None for an answer."""
    if any(e.event_type == "tool.malformed" for e in completion.trace):
        return "malformed_call"
    if completion.finish_reason is FinishReason.LENGTH:
        return "length"
    return None


def _executors(pipe: Pipeline, tools: Sequence[Tool]) -> dict[str, ToolExecutor]:
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence) or not tools:
        raise InvalidValueError("tools", tools, "must be a non-empty list of functions, "
                                "executors or registered tool names")
    out: dict[str, ToolExecutor] = {}
    for tool in tools:
        executor = _executor(pipe, tool)
        name = executor.spec.name
        if name in out:
            raise InvalidValueError("tools", name, "two tools have this name")
        out[name] = executor
    return out


def _executor(pipe: Pipeline, tool: Tool) -> ToolExecutor:
    if isinstance(tool, str):
        if pipe.registry is None:
            raise InvalidValueError("tools", tool, "this pipeline has no registry to find "
                                    "named tools in (build it with build())")
        found = pipe.registry.create("tool", tool, BuildContext())
        if not isinstance(found, ToolExecutor):
            raise InvalidValueError("tools", tool, "the plugin's factory did not make a "
                                    "ToolExecutor")
        return found
    if isinstance(tool, ToolExecutor):
        return tool
    if callable(tool):
        return FunctionTool(tool)
    raise InvalidValueError("tools", tool, "not a function, an executor or a tool name")


def _policy(pipe: Pipeline, policy: ToolPolicy | str | None) -> ToolPolicy:
    if policy is None:
        return AllowAll()
    if isinstance(policy, str):
        if pipe.registry is None:
            raise InvalidValueError("policy", policy, "this pipeline has no registry")
        policy = pipe.registry.create("tool_policy", policy, BuildContext())
    if not isinstance(policy, ToolPolicy):
        raise InvalidValueError("policy", policy, "must be a ToolPolicy (name and decide) or "
                                "a registered policy's name")
    return policy


def _ledger(ledger: Ledger | str | Path | None) -> Ledger:
    if ledger is None:
        return MemoryLedger()
    if isinstance(ledger, (str, Path)):
        return JsonlLedger(ledger)
    if not isinstance(ledger, Ledger):
        raise InvalidValueError("ledger", ledger, "must be a Ledger or a file path")
    return ledger
