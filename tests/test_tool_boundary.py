"""The commit boundary: validation, policy, the durable ledger, idempotency, cancel, undo.

Oracles: a counting executor (how often the world was touched), the ledger file read back as
JSON lines, ``jsonschema`` and transformers' ``get_json_schema`` for the schemas that typed
functions describe, and the trace checker (invariants 7 and 8) on the traces written here.
"""

from __future__ import annotations

import enum
import json
import threading
from pathlib import Path
from typing import Any, Literal

import jsonschema
import pytest

from pipeline.errors import ArtifactError, InvalidValueError
from pipeline.events import Event, Tracer
from pipeline.tools import (
    AllowAll, Decision, Entry, FunctionTool, JsonlLedger, MemoryLedger, Rules, ToolBoundary,
    ToolExecutor, ToolPolicy, Verdict, tool_spec,
)
from pipeline.trace.check import check
from pipeline.contracts.request import ToolCall
from trace_runs import append


class Unit(enum.Enum):
    CELSIUS = "celsius"
    FAHRENHEIT = "fahrenheit"


def forecast(city: str, days: int, unit: Unit = Unit.CELSIUS, hourly: bool = False,
             tags: list[str] | None = None, mode: Literal["fast", "exact"] = "fast",
             weights: dict[str, float] | None = None, scale: float = 1.0) -> dict[str, Any]:
    """Forecast the weather of a city.

    Args:
        city: The city's name,
            as people write it.
        days: How many days ahead.
        unit: The temperature unit.
        hourly: Whether to give hourly values.
        tags: Labels to attach.
        mode: How hard to try.
        weights: Weights by station.
        scale: A factor.
    """
    return {"city": city, "days": days, "unit": unit.value, "scale": scale}


SAMPLES: list[dict[str, Any]] = [
    {"city": "Oslo", "days": 3}, {"city": "Oslo"}, {"days": 3}, {"city": 1, "days": 3},
    {"city": "Oslo", "days": 2.5}, {"city": "Oslo", "days": 1, "unit": "fahrenheit"},
    {"city": "Oslo", "days": 1, "unit": "kelvin"}, {"city": "Oslo", "days": 1, "hourly": "yes"},
    {"city": "Oslo", "days": 1, "tags": ["a", "b"]}, {"city": "Oslo", "days": 1, "tags": [1]},
    {"city": "Oslo", "days": 1, "tags": None}, {"city": "Oslo", "days": 1, "mode": "exact"},
    {"city": "Oslo", "days": 1, "mode": "slow"}, {"city": "Oslo", "days": 1, "weights": {"x": 1}},
    {"city": "Oslo", "days": 1, "weights": {"x": "y"}}, {"city": "Oslo", "days": 1, "scale": 2},
]


def test_schemas_from_typed_functions_agree_with_transformers() -> None:
    """transformers' ``get_json_schema`` reads the same hints and docstring: both schemas
    accept and reject the same arguments, and describe the same things."""
    utils = pytest.importorskip("transformers.utils")
    theirs = utils.get_json_schema(forecast)["function"]
    ours = tool_spec(forecast)
    assert ours.name == theirs["name"] == "forecast"
    assert ours.description == theirs["description"] == "Forecast the weather of a city."
    mine, other = dict(ours.to_template()["function"]["parameters"]), theirs["parameters"]
    for name, prop in other["properties"].items():
        if prop.pop("nullable", False):  # OpenAPI's spelling; JSON Schema says it with null
            other["properties"][name] = {"anyOf": [prop, {"type": "null"}],
                                         "description": prop.get("description")}
    assert sorted(mine["required"]) == sorted(other["required"]) == ["city", "days"]
    for name, prop in other["properties"].items():
        assert mine["properties"][name]["description"] == prop["description"], name
    for sample in SAMPLES:
        assert (jsonschema.Draft202012Validator(mine).is_valid(sample)
                == jsonschema.Draft202012Validator(other).is_valid(sample)), sample
    assert not jsonschema.Draft202012Validator(mine).is_valid({"city": "Oslo", "days": 1,
                                                                "extra": 1})


def test_functions_that_cannot_be_described_are_refused_by_name() -> None:
    def untyped(x):  # type: ignore[no-untyped-def]
        return x

    def variadic(*args: int) -> None: ...

    def odd(x: set[int]) -> None: ...

    def keys(x: dict[int, str]) -> None: ...

    for fn, says in ((untyped, "parameter x"), (variadic, "parameter args"),
                     (odd, "parameter x"), (keys, "dict[str")):
        with pytest.raises(InvalidValueError, match=r"(?s)" + says.replace("[", r"\[")):
            tool_spec(fn)


class Counting:
    """An executor that counts how often it touched the world."""

    def __init__(self, fail: bool = False, during: threading.Event | None = None) -> None:
        self.runs: list[dict[str, Any]] = []
        self.undone: list[Any] = []
        self.fail = fail
        self.during = during
        self.spec = tool_spec(transfer)

    def execute(self, arguments: Any) -> Any:
        self.runs.append(dict(arguments))
        if self.during is not None:
            self.during.set()  # the caller cancels while the write happens
        if self.fail:
            raise RuntimeError("bank offline")
        return {"receipt": len(self.runs)}

    def compensate(self, arguments: Any, result: Any) -> Any:
        self.undone.append(result)
        return {"refunded": result["receipt"]}


def transfer(to: str, amount: int) -> dict[str, int]:
    """Move money.

    Args:
        to: The recipient.
        amount: How much.
    """
    return {"receipt": 0}


CALL = ToolCall("transfer", '{"to": "bob", "amount": 5}', "call_1")


def run(boundary: ToolBoundary, call: ToolCall = CALL, key: str = "k1"
        ) -> tuple[Any, tuple[Event, ...]]:
    tracer = Tracer("t1")
    for kind in ("proposed", "parsed"):  # what the engine emits before the boundary
        tracer.emit("tools", "tool." + kind, {"call_id": call.id, "name": call.name})
    return boundary.process(call, tracer, key), tracer.events


def kinds(events: tuple[Event, ...]) -> list[str]:
    return [e.event_type[5:] for e in events if e.event_type.startswith("tool.")]


def test_a_retried_key_never_executes_twice_even_after_a_restart(tmp_path: Path) -> None:
    counter = Counting()
    path = tmp_path / "ledger.jsonl"
    boundary = ToolBoundary({"transfer": counter}, policy=AllowAll(), ledger=JsonlLedger(path))
    first, events = run(boundary)
    assert first.status == "executed" and first.result == {"receipt": 1}
    assert kinds(events) == ["proposed", "parsed", "validated", "authorized", "committed",
                             "executed"]
    again, events = run(boundary)
    restarted = ToolBoundary({"transfer": counter}, policy=AllowAll(), ledger=JsonlLedger(path))
    third, _ = run(restarted)
    assert len(counter.runs) == 1
    assert again.status == third.status == "reused" and third.result == {"receipt": 1}
    assert kinds(events)[-1] == "reused"
    states = [r["state"] for r in JsonlLedger(path).history()]
    assert states == ["committed", "executed"]  # written ahead, then the outcome
    other, _ = run(boundary, key="k2")  # a different key is a different operation
    assert other.status == "executed" and len(counter.runs) == 2


def test_a_commit_without_an_outcome_is_in_doubt_and_never_rerun(tmp_path: Path) -> None:
    ledger = MemoryLedger()
    ledger.record(Entry("k1", "committed", "call_1", "transfer", CALL.arguments))
    counter = Counting()
    outcome, events = run(ToolBoundary({"transfer": counter}, policy=AllowAll(),
                                       ledger=ledger))
    assert outcome.status == "failed" and "in doubt" in str(outcome.error)
    assert counter.runs == [] and "committed" not in kinds(events)


def test_a_torn_last_record_never_counted_but_damage_elsewhere_is_an_error(
        tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    good = json.dumps({"key": "k1", "state": "committed", "call_id": "c", "name": "transfer",
                       "arguments": "{}"})
    path.write_text(good + "\n" + '{"key": "k2", "sta')
    ledger = JsonlLedger(path)
    assert ledger.get("k1") is not None and ledger.get("k2") is None
    ledger.record(Entry("k3", "committed", "c3", "transfer", "{}"))
    assert [r["key"] for r in JsonlLedger(path).history()] == ["k1", "k3"]
    path.write_text('{"key": "k2", "sta\n' + good + "\n")
    with pytest.raises(ArtifactError, match="line 1"):
        JsonlLedger(path)


def test_a_denying_policy_is_honoured_and_traced() -> None:
    counter = Counting()
    rules = Rules({"transfer": lambda a: Verdict(Decision.DENY, "over the limit")
                   if a["amount"] > 3 else Decision.ALLOW})
    outcome, events = run(ToolBoundary({"transfer": counter}, policy=rules,
                                       ledger=MemoryLedger()))
    assert outcome.status == "denied" and counter.runs == []
    assert outcome.content == "denied: over the limit"
    assert kinds(events)[2:] == ["validated", "denied"]
    denied = next(e for e in events if e.event_type == "tool.denied")
    assert denied.payload["reason"] == "over the limit" and denied.payload["policy"] == "rules"
    small = ToolCall("transfer", '{"to": "bob", "amount": 2}', "call_2")
    allowed, _ = run(ToolBoundary({"transfer": counter}, policy=rules, ledger=MemoryLedger()),
                     small)
    assert allowed.status == "executed" and len(counter.runs) == 1


def test_ask_defers_to_the_callback_and_no_callback_means_no() -> None:
    asking = Rules({"transfer": Decision.ASK})
    asked: list[str] = []
    counter = Counting()

    def yes(call: ToolCall, verdict: Verdict) -> bool:
        asked.append(call.name)
        return True

    outcome, events = run(ToolBoundary({"transfer": counter}, policy=asking,
                                       ledger=MemoryLedger(), ask=yes))
    assert outcome.status == "executed" and asked == ["transfer"]
    authorized = next(e for e in events if e.event_type == "tool.authorized")
    assert authorized.payload["policy"] == "ask" and "asked" in kinds(events)
    refused, events = run(ToolBoundary({"transfer": counter}, policy=asking,
                                       ledger=MemoryLedger()))
    assert refused.status == "denied" and "pass ask=" in str(refused.error)
    assert len(counter.runs) == 1


@pytest.mark.parametrize("call,says", [
    (ToolCall("transfer", '{"to": "bob"}', "c"), "'amount' is a required property"),
    (ToolCall("transfer", '{"to": "bob", "amount": "5"}', "c"), "amount: '5' is not of type"),
    (ToolCall("wire", '{}', "c"), "no tool named 'wire' (offered: transfer)"),
])
def test_arguments_that_do_not_validate_never_reach_the_policy(call: ToolCall, says: str
                                                               ) -> None:
    class Watching:
        name = "watching"
        seen: list[str] = []

        def decide(self, tool: str, arguments: Any) -> Verdict:
            self.seen.append(tool)
            return Verdict(Decision.ALLOW)

    policy = Watching()
    counter = Counting()
    outcome, events = run(ToolBoundary({"transfer": counter}, policy=policy,
                                       ledger=MemoryLedger()), call)
    assert outcome.status == "invalid" and says in str(outcome.error)
    assert policy.seen == [] and counter.runs == [] and kinds(events)[-1] == "invalid"


def test_a_failed_execution_is_recorded_and_not_retried() -> None:
    counter = Counting(fail=True)
    boundary = ToolBoundary({"transfer": counter}, policy=AllowAll(), ledger=MemoryLedger())
    outcome, events = run(boundary)
    assert outcome.status == "failed" and "bank offline" in str(outcome.error)
    assert kinds(events)[-1] == "failed"
    again, _ = run(boundary)
    assert again.status == "reused" and "bank offline" in str(again.error)
    assert len(counter.runs) == 1


def finished(events: tuple[Event, ...]) -> list[Event]:
    """A boundary trace closed like a request's (so the checker sees an ended request)."""
    out = list(events)
    for kind in ("generation.finished", "resources.released"):
        out = append(out, kind, {"reason": "eos", "state": "finished"}, "engine")
    return out


def test_a_cancel_after_the_commit_is_recorded_and_is_no_rollback() -> None:
    cancel = threading.Event()
    counter = Counting(during=cancel)
    boundary = ToolBoundary({"transfer": counter}, policy=AllowAll(), ledger=MemoryLedger(),
                            cancel=cancel)
    outcome, events = run(boundary)
    assert outcome.status == "executed" and len(counter.runs) == 1
    assert kinds(events)[-2:] == ["executed", "cancel_after_commit"]
    report = check(finished(events))
    assert 7 not in report.violated and 8 not in report.violated
    as_rollback = [e if e.event_type != "tool.cancel_after_commit" else
                   Event(e.trace_id, e.event_id, e.parent_event_id, e.component,
                         "tool.rolled_back", e.monotonic_ns, e.payload) for e in events]
    assert 8 in check(finished(tuple(as_rollback))).violated
    before, events = run(boundary, key="k-cancelled")  # cancelled before its commit
    assert before.status == "cancelled" and len(counter.runs) == 1
    assert kinds(events)[-1] == "cancelled"


def test_compensation_is_a_separate_explicit_action() -> None:
    counter = Counting()
    boundary = ToolBoundary({"transfer": counter}, policy=AllowAll(), ledger=MemoryLedger())
    run(boundary)
    tracer = Tracer("t2")
    assert boundary.compensate("k1", tracer) == {"refunded": 1}
    assert [e.event_type for e in tracer.events] == ["tool.compensated"]
    assert counter.undone == [{"receipt": 1}]
    # the compensation is a record of its own: the call's outcome stays as it was
    assert boundary.ledger.get("k1").state == "executed"
    assert boundary.ledger.compensation("k1").result == {"refunded": 1}
    with pytest.raises(InvalidValueError, match="compensated already"):
        boundary.compensate("k1", tracer)
    with pytest.raises(InvalidValueError, match="no executed call"):
        boundary.compensate("k-never", tracer)
    undo_fn = FunctionTool(transfer, undo=lambda result, to, amount: f"refund {amount} to {to}")
    assert undo_fn.compensate({"to": "bob", "amount": 5}, {}) == "refund 5 to bob"
    with pytest.raises(NotImplementedError):
        FunctionTool(transfer).compensate({}, None)


def test_executors_and_policies_satisfy_their_protocols() -> None:
    executor: ToolExecutor = FunctionTool(forecast)
    assert isinstance(executor, ToolExecutor) and isinstance(Counting(), ToolExecutor)
    for policy in (AllowAll(), Rules({})):
        checked: ToolPolicy = policy
        assert isinstance(checked, ToolPolicy)
    assert FunctionTool(forecast).execute({"city": "Oslo", "days": 1, "unit": "fahrenheit",
                                           "scale": 2}) == {"city": "Oslo", "days": 1,
                                                            "unit": "fahrenheit", "scale": 2.0}
