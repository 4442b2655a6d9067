"""The commit boundary: a proposed tool call changes nothing until it has crossed it.

Owns :class:`ToolBoundary` and :class:`CallOutcome`. A call the reader parsed (``tool.proposed``
and ``tool.parsed``, emitted by the engine) moves on here (DESIGN §11):

1. validated against its tool's JSON schema (``jsonschema``) — else ``tool.invalid``;
2. authorized by the policy (``ask`` defers to a callback; no callback is no) — else
   ``tool.denied``; ``tool.asked`` records a question;
3. committed: the idempotency key and the call are written durably to the ledger *before*
   anything runs (``tool.committed``); a key the ledger already holds is never executed
   again: its recorded outcome is returned (``tool.reused``), and a key committed with no
   outcome is in doubt and fails rather than risk a second effect;
4. executed by the tool's executor — ``tool.executed`` with the result's digest, or
   ``tool.failed`` — and the outcome is written to the ledger.

A cancel before the commit stops the call (``tool.cancelled``); a cancel after it is not a
rollback: the call runs to its outcome and ``tool.cancel_after_commit`` records that the
effect stands. Undoing an effect is a separate, explicit action (:meth:`ToolBoundary.compensate`,
``tool.compensated`` or ``tool.compensation_failed``). Every event carries ``call_id`` and
``name``; invariants 7 and 8 (:mod:`pipeline.trace.invariants`) check the order.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from pipeline.errors import InvalidValueError
from pipeline.events import Tracer, digest_json, digest_text
from pipeline.tools.executor import Decision, ToolExecutor, ToolPolicy, Verdict
from pipeline.tools.ledger import Entry, Ledger
from pipeline.types import ToolCall, thaw

Ask = Callable[[ToolCall, Verdict], bool]
"""Answers a policy's question about a call: True allows it."""


@attrs.frozen
class CallOutcome:
    """What became of one call: ``status`` is ``executed``, ``reused``, ``failed``,
    ``invalid``, ``denied``, ``cancelled`` or ``skipped``; ``content`` is what the model
    reads back in the tool message."""

    call: ToolCall
    key: str | None
    status: str
    result: Any = None
    error: str | None = None

    @property
    def content(self) -> str:
        """The tool message's text: the result (JSON unless it is a string), or why not."""
        if self.status in ("executed", "reused") and self.error is None:
            return self.result if isinstance(self.result, str) else json.dumps(
                self.result, ensure_ascii=False, default=str)
        return f"{self.status}: {self.error}"


class ToolBoundary:
    """Moves calls across the boundary for one set of tools, one policy and one ledger.

    Thread-safe as long as its executors are; ``cancel`` (a ``threading.Event``) is the
    model request's cancellation, checked before the commit and reported after it."""

    def __init__(self, tools: Mapping[str, ToolExecutor], *, policy: ToolPolicy,
                 ledger: Ledger, ask: Ask | None = None,
                 cancel: threading.Event | None = None) -> None:
        self.tools = dict(tools)
        self.policy = policy
        self.ledger = ledger
        self.ask = ask
        self.cancel = cancel
        import jsonschema  # here, not at import: only a tool loop needs the validator

        self._validators: dict[str, Any] = {}
        for name, tool in self.tools.items():
            schema = dict(thaw(tool.spec.parameters))
            try:
                jsonschema.Draft202012Validator.check_schema(schema)
            except jsonschema.SchemaError as exc:
                raise InvalidValueError(f"tool {name}", exc.message,
                                        "its parameters are not a valid JSON schema") from exc
            self._validators[name] = jsonschema.Draft202012Validator(schema)

    def process(self, call: ToolCall, tracer: Tracer, key: str) -> CallOutcome:
        """Take a parsed ``call`` through validation, authorization, commit and execution
        under idempotency ``key``, emitting each transition into ``tracer``."""

        last = [_parsed_event(tracer, call)]  # each transition's parent is the one before

        def emit(kind: str, **payload: Any) -> None:
            last[0] = tracer.emit("tools", "tool." + kind, {"call_id": call.id,
                                                            "name": call.name, **payload},
                                  last[0])

        arguments, errors = self._validate(call)
        if errors:
            emit("invalid", errors=errors)
            return CallOutcome(call, key, "invalid", error="; ".join(errors))
        emit("validated", valid=True, schema_digest=digest_json(
            thaw(self.tools[call.name].spec.parameters)))
        verdict = self._authorize(call, arguments, emit)
        if verdict is not None:
            return CallOutcome(call, key, "denied", error=verdict.reason or "not allowed")
        if self.cancel is not None and self.cancel.is_set():
            emit("cancelled", stage="before commit")
            return CallOutcome(call, key, "cancelled", error="cancelled before the commit")
        earlier = self.ledger.get(key)
        if earlier is not None:
            return self._reuse(call, key, earlier, emit)
        self.ledger.record(Entry(key, "committed", call.id, call.name, call.arguments))
        emit("committed", key=key, arguments_digest=digest_text(call.arguments))
        outcome = self._execute(call, key, arguments, emit)
        if self.cancel is not None and self.cancel.is_set():
            emit("cancel_after_commit", key=key, outcome=outcome.status,
                 note="the call had crossed the commit boundary: its effect stands; "
                      "compensate explicitly to undo it")
        return outcome

    def _validate(self, call: ToolCall) -> tuple[dict[str, Any], list[str]]:
        validator = self._validators.get(call.name)
        if validator is None:
            offered = ", ".join(sorted(self.tools)) or "none"
            return {}, [f"no tool named {call.name!r} (offered: {offered})"]
        try:
            arguments = json.loads(call.arguments)
        except ValueError as exc:
            return {}, [f"the arguments are not JSON: {exc}"]
        if not isinstance(arguments, dict):
            return {}, ["the arguments are not a JSON object"]
        errors = sorted(validator.iter_errors(arguments), key=lambda e: list(e.path))
        return arguments, [_where(e) + e.message for e in errors]

    def _authorize(self, call: ToolCall, arguments: Mapping[str, Any],
                   emit: Callable[..., None]) -> Verdict | None:
        """None when allowed (``tool.authorized``), else the denying verdict."""
        verdict = self.policy.decide(call.name, arguments)
        by = self.policy.name
        if verdict.decision is Decision.ASK:
            emit("asked", policy=by, reason=verdict.reason)
            allowed = self.ask is not None and self.ask(call, verdict)
            reason = verdict.reason if self.ask is not None else (
                f"{verdict.reason}; the policy asks and no one was given to answer (pass ask=)")
            verdict, by = Verdict(Decision.ALLOW if allowed else Decision.DENY, reason), "ask"
        if verdict.decision is Decision.ALLOW:
            emit("authorized", decision="allow", policy=by, reason=verdict.reason)
            return None
        emit("denied", decision="deny", policy=by, reason=verdict.reason)
        return verdict

    def _execute(self, call: ToolCall, key: str, arguments: Mapping[str, Any],
                 emit: Callable[..., None]) -> CallOutcome:
        try:
            result = self.tools[call.name].execute(arguments)
        except Exception as exc:  # the tool's failure is the call's outcome, not ours
            error = f"{type(exc).__name__}: {exc}"
            self.ledger.record(Entry(key, "failed", call.id, call.name, call.arguments,
                                     error=error))
            emit("failed", key=key, error=error)
            return CallOutcome(call, key, "failed", error=error)
        self.ledger.record(Entry(key, "executed", call.id, call.name, call.arguments, result))
        emit("executed", key=key, result_digest=digest_json(result))
        return CallOutcome(call, key, "executed", result)

    def _reuse(self, call: ToolCall, key: str, earlier: Entry,
               emit: Callable[..., None]) -> CallOutcome:
        """The key crossed the boundary before: return its record, never run it again."""
        if earlier.state == "committed":
            error = ("in doubt: an earlier attempt committed this call and recorded no "
                     "outcome, so it may have had its effect; it is not run again")
            emit("reused", key=key, state="committed", in_doubt=True)
            return CallOutcome(call, key, "failed", error=error)
        emit("reused", key=key, state=earlier.state, result_digest=digest_json(earlier.result))
        return CallOutcome(call, key, "reused", earlier.result, earlier.error)

    def compensate(self, key: str, tracer: Tracer) -> Any:
        """Undo the executed call under ``key`` with its executor's ``compensate``: an
        explicit action of its own (``tool.compensated``), never implied by a cancel."""
        entry = self.ledger.get(key)
        if entry is None or entry.state != "executed":
            raise InvalidValueError("key", key, "no executed call is recorded under it "
                                    f"(state: {entry.state if entry else 'none'})")
        payload = {"call_id": entry.call_id, "name": entry.name, "key": key}
        try:
            result = self.tools[entry.name].compensate(json.loads(entry.arguments),
                                                       entry.result)
        except Exception as exc:
            tracer.emit("tools", "tool.compensation_failed",
                        {**payload, "error": f"{type(exc).__name__}: {exc}"})
            raise
        self.ledger.record(attrs.evolve(entry, state="compensated", result=result))
        tracer.emit("tools", "tool.compensated", {**payload, "result_digest": digest_json(result)})
        return result


def _parsed_event(tracer: Tracer, call: ToolCall) -> int | None:
    """The id of the ``tool.parsed`` event of ``call`` in the trace so far, if any."""
    for event in reversed(tracer.events):
        if event.event_type == "tool.parsed" and event.payload.get("call_id") == call.id:
            return event.event_id
    return None


def _where(error: Any) -> str:
    path = "/".join(str(p) for p in error.path)
    return f"{path}: " if path else ""
