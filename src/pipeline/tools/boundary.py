"""The commit boundary: a proposed tool call changes nothing until it has crossed it.

Owns :class:`ToolBoundary` and :class:`CallOutcome`. A call the reader parsed (``tool.proposed``
and ``tool.parsed``, emitted by the engine) moves on here (docs/design.md §11):

1. validated against its tool's JSON schema (``jsonschema``) — else ``tool.invalid``;
2. authorized by the policy (``ask`` defers to a callback; no callback is no) — else
   ``tool.denied``; ``tool.asked`` records a question;
3. committed: the ledger's claim (:meth:`~pipeline.tools.ledger.Ledger.claim`, an atomic
   check-and-set across threads and processes) writes the idempotency key and the call
   durably *before* anything runs (``tool.committed``). A key someone else claimed is never
   executed here: the boundary waits while its holder is alive and returns the recorded
   outcome (``tool.reused``); a key committed with no outcome and no live holder is in doubt
   — the executor's lookup (:class:`~pipeline.tools.executor.OutcomeLookup`) may settle it,
   else it fails rather than risk a second effect, until :meth:`ToolBoundary.resolve`;
4. executed by the tool's executor (with the key, when it is a
   :class:`~pipeline.tools.executor.KeyedExecutor`) — ``tool.executed`` with the result's
   digest, or ``tool.failed`` — and the outcome is written to the ledger.

A cancel before the commit stops the call (``tool.cancelled``); a cancel after it is not a
rollback: the call runs to its outcome and ``tool.cancel_after_commit`` records that the
effect stands. Undoing an effect is a separate, explicit action (:meth:`ToolBoundary.compensate`,
``tool.compensated`` or ``tool.compensation_failed``), recorded beside the call's outcome:
a retry after it returns status ``compensated``, never the compensation's result as the
call's. Every event carries ``call_id`` and ``name``; invariants 7 and 8
(:mod:`pipeline.trace.invariants`) check the order.

Crashes: each transition is emitted after the ledger holds it, and a
:class:`~pipeline.events.JsonlSink` makes these events durable before the effect runs. A
process killed between a ledger write and its event leaves the trace one step behind the
ledger; a later attempt in the same trace, :meth:`ToolBoundary.resolve` and
:meth:`ToolBoundary.recover` write the missing ``tool.committed`` and outcome from the ledger
(``recovered: true``), so trace and ledger agree again.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from pipeline.errors import InvalidValueError
from pipeline.events import Tracer, digest_json, digest_text
from pipeline.tools.executor import (
    Decision, KeyedExecutor, OutcomeLookup, ToolExecutor, ToolPolicy, Verdict,
)
from pipeline.tools.ledger import OUTCOMES, Entry, Ledger, Resolution, resolve
from pipeline.contracts.request import ToolCall, check_tool_parameters, thaw

Ask = Callable[[ToolCall, Verdict], bool]
"""Answers a policy's question about a call: True allows it."""

IN_DOUBT = ("in doubt: an earlier attempt committed this call and recorded no outcome, so it "
            "may have had its effect; it is not run again until it is resolved")
UNDONE = ("the call executed and its effect was then undone by a compensation; it is not run "
          "again")


@attrs.frozen
class CallOutcome:
    """What became of one call: ``status`` is ``executed``, ``reused`` (an earlier attempt's
    recorded outcome: ``result``, or ``error`` when it failed), ``compensated`` (an earlier
    attempt executed and was then compensated: ``result`` is the call's own result,
    ``compensation`` what the compensation returned, ``error`` says the effect was undone),
    ``failed`` (also a call in doubt), ``invalid``, ``denied``, ``cancelled`` or
    ``skipped``; ``content`` is what the model reads back in the tool message."""

    call: ToolCall
    key: str | None
    status: str
    result: Any = None
    error: str | None = None
    compensation: Any = None

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
            check_tool_parameters(tool.spec)
            self._validators[name] = jsonschema.Draft202012Validator(
                dict(thaw(tool.spec.parameters)))

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
        verdict = self._authorize(call, key, arguments, emit)
        if verdict is not None:
            return CallOutcome(call, key, "denied", error=verdict.reason or "not allowed")
        if self.cancel is not None and self.cancel.is_set():
            emit("cancelled", stage="before commit")
            return CallOutcome(call, key, "cancelled", error="cancelled before the commit")
        earlier = self.ledger.claim(Entry(key, "committed", call.id, call.name, call.arguments,
                                          trace_id=tracer.trace_id))
        if earlier is not None:
            return self._reuse(call, key, earlier, tracer, emit)
        try:  # from here this attempt holds the key: it ends with an outcome, or in doubt
            emit("committed", key=key, arguments_digest=digest_text(call.arguments))
        except BaseException:
            self.ledger.release(key)
            raise
        outcome = self._execute(call, key, arguments, tracer, emit)
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

    def _authorize(self, call: ToolCall, key: str, arguments: Mapping[str, Any],
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
            emit("authorized", decision="allow", policy=by, reason=verdict.reason, key=key)
            return None
        emit("denied", decision="deny", policy=by, reason=verdict.reason)
        return verdict

    def _execute(self, call: ToolCall, key: str, arguments: Mapping[str, Any], tracer: Tracer,
                 emit: Callable[..., None]) -> CallOutcome:
        tool = self.tools[call.name]
        entry = Entry(key, "executed", call.id, call.name, call.arguments,
                      trace_id=tracer.trace_id)
        try:
            if isinstance(tool, KeyedExecutor):
                entry = attrs.evolve(entry, result=tool.execute_keyed(arguments, key))
            else:
                entry = attrs.evolve(entry, result=tool.execute(arguments))
        except Exception as exc:  # the tool's failure is the call's outcome, not ours
            entry = attrs.evolve(entry, state="failed", error=f"{type(exc).__name__}: {exc}")
        except BaseException:  # interrupted mid-effect: nothing to record, so in doubt
            self.ledger.release(key)
            raise
        try:
            self.ledger.record(entry)
        except BaseException:  # the outcome is not on record: the call is in doubt
            self.ledger.release(key)
            raise
        if entry.state == "failed":
            emit("failed", key=key, error=entry.error)
            return CallOutcome(call, key, "failed", error=entry.error)
        emit("executed", key=key, result_digest=digest_json(entry.result))
        return CallOutcome(call, key, "executed", entry.result)

    def _reuse(self, call: ToolCall, key: str, earlier: Entry, tracer: Tracer,
               emit: Callable[..., None]) -> CallOutcome:
        """The key crossed the boundary before: return its record, never run it again."""
        if earlier.state == "committed":
            earlier = self._look_up(earlier)
        self._catch_up(tracer, earlier)
        if earlier.state == "committed":
            emit("reused", key=key, state="committed", in_doubt=True)
            return CallOutcome(call, key, "failed", error=IN_DOUBT)
        settled = {} if earlier.resolved_by is None else {"resolved_by": earlier.resolved_by}
        compensation = self.ledger.compensation(key)
        if compensation is not None:
            emit("reused", key=key, state="compensated", **settled,
                 result_digest=digest_json(earlier.result),
                 compensation_digest=digest_json(compensation.result))
            return CallOutcome(call, key, "compensated", earlier.result, UNDONE,
                               compensation.result)
        emit("reused", key=key, state=earlier.state, **settled,
             result_digest=digest_json(earlier.result))
        return CallOutcome(call, key, "reused", earlier.result, earlier.error)

    def _look_up(self, entry: Entry) -> Entry:
        """Ask the executor about an in-doubt call; record what it knows."""
        tool = self.tools.get(entry.name)
        if not isinstance(tool, OutcomeLookup):
            return entry
        try:
            found = tool.lookup(entry.key)
        except Exception:  # a lookup that fails cannot tell, as its contract says
            return entry
        if not isinstance(found, Resolution):
            return entry
        try:
            return resolve(self.ledger, entry.key, found, by="lookup")
        except InvalidValueError:  # settled meanwhile (its holder, or another resolver)
            return self.ledger.get(entry.key) or entry

    def resolve(self, key: str, outcome: Resolution, tracer: Tracer | None = None, *,
                by: str = "operator") -> Entry:
        """Settle the in-doubt call under ``key``: ``outcome`` becomes its recorded outcome
        (``resolved_by=by``), which every later attempt returns without executing. With
        ``tracer`` (the call's trace, e.g. ``Tracer.resume`` of it as read back), the trace
        gets the outcome (and the commit, if the crash came before its event) from the
        ledger. Refused for a key that is not in doubt; waits out a call in flight."""
        settled = resolve(self.ledger, key, outcome, by)
        if tracer is not None:
            self._catch_up(tracer, settled)
        return settled

    def recover(self, tracer: Tracer) -> tuple[str, ...]:
        """After a crash: bring the trace in ``tracer`` level with the ledger for every call
        it took to the boundary (the commit and the outcome the ledger holds and the trace
        lacks, each ``recovered: true``), asking the executors about calls in doubt.
        Returns the keys still in doubt, for :meth:`resolve`. Meant for a restart: a call
        in flight elsewhere looks in doubt to it."""
        keys: dict[Any, str] = {}
        for event in tracer.events:
            if event.event_type in ("tool.authorized", "tool.committed"):
                if "key" in event.payload:
                    keys.setdefault(event.payload.get("call_id"), str(event.payload["key"]))
        doubtful = []
        for call_id, key in keys.items():
            entry = self.ledger.get(key)
            if entry is None or (entry.trace_id, entry.call_id) != (tracer.trace_id, call_id):
                continue  # nothing crossed, or another attempt's commit
            if entry.state == "committed":
                entry = self._look_up(entry)
            self._catch_up(tracer, entry)
            if entry.state == "committed":
                doubtful.append(key)
        return tuple(doubtful)

    def _catch_up(self, tracer: Tracer, entry: Entry) -> None:
        """Write into ``tracer`` what the ledger holds of ``entry``'s call and the trace
        lacks: its commit, then its outcome; only in the trace of the attempt that committed
        it (after a crash, that trace resumed), for the call it authorized."""
        if entry.trace_id != tracer.trace_id:
            return
        mine = [e for e in tracer.events if e.event_type.startswith("tool.")
                and e.payload.get("call_id") == entry.call_id
                and e.payload.get("key", entry.key) == entry.key]
        seen = {e.event_type[5:] for e in mine}
        if "authorized" not in seen:
            return
        base = {"call_id": entry.call_id, "name": entry.name, "key": entry.key,
                "recovered": True}
        parent = mine[-1].event_id
        if "committed" not in seen:
            parent = tracer.emit("tools", "tool.committed", {
                **base, "arguments_digest": digest_text(entry.arguments)}, parent)
        if entry.state in OUTCOMES and not seen & set(OUTCOMES):
            detail = ({"result_digest": digest_json(entry.result)}
                      if entry.state == "executed" else {"error": entry.error})
            settled = {} if entry.resolved_by is None else {"resolved_by": entry.resolved_by}
            tracer.emit("tools", "tool." + entry.state, {**base, **detail, **settled}, parent)

    def compensate(self, key: str, tracer: Tracer) -> Any:
        """Undo the executed call under ``key`` with its executor's ``compensate``: an
        explicit action of its own (``tool.compensated``), never implied by a cancel, and a
        record of its own in the ledger (the call's outcome stays as it was)."""
        entry = self.ledger.get(key)
        if entry is None or entry.state != "executed":
            raise InvalidValueError("key", key, "no executed call is recorded under it "
                                    f"(state: {entry.state if entry else 'none'})")
        if self.ledger.compensation(key) is not None:
            raise InvalidValueError("key", key, "its call was compensated already")
        payload = {"call_id": entry.call_id, "name": entry.name, "key": key}
        try:
            result = self.tools[entry.name].compensate(json.loads(entry.arguments),
                                                       entry.result)
        except Exception as exc:
            tracer.emit("tools", "tool.compensation_failed",
                        {**payload, "error": f"{type(exc).__name__}: {exc}"})
            raise
        self.ledger.record(Entry(key, "compensated", entry.call_id, entry.name,
                                 entry.arguments, result, trace_id=entry.trace_id))
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
