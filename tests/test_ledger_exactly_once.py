"""Exactly-once tool execution: the ledger's claim, its locks, resolution and compensation.

Oracles: an effect log the executor appends to (one line per time the world changed, written
and fsynced before the executor returns), the ledger file read back as JSON lines, and the
outcome every caller got. A slow disk is simulated by a ledger whose durable write sleeps
10 ms inside the critical section: the window in which two attempts both used to find no
record and both execute.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from pipeline.errors import InvalidValueError
from pipeline.events import Tracer
from pipeline.tools import (
    AllowAll, CallOutcome, Entry, FunctionTool, JsonlLedger, KeyedExecutor, Ledger,
    MemoryLedger, OutcomeLookup, Resolution, ToolBoundary, ToolExecutor, tool_spec,
)
from pipeline.contracts.request import ToolCall

KEY = "run-1/round-0/call-0"
CALL = ToolCall("transfer", '{"to": "bob", "amount": 5}', "call_1")


def transfer(to: str, amount: int) -> dict[str, Any]:
    """Move money.

    Args:
        to: The recipient.
        amount: How much.
    """
    return {}


class SlowDisk(JsonlLedger):
    """A ledger whose every durable write takes 10 ms longer, under the ledger's lock."""

    def write_record(self, line: bytes) -> None:
        time.sleep(0.010)
        super().write_record(line)


class Effects:
    """An executor whose effect is a line in a log file (with the key it was given), and
    which can look an effect up there."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.spec = tool_spec(transfer)
        self.undone: list[Any] = []

    def execute(self, arguments: Mapping[str, Any]) -> Any:
        return self.execute_keyed(arguments, "")

    def execute_keyed(self, arguments: Mapping[str, Any], key: str) -> Any:
        receipt = f"{os.getpid()}-{threading.get_ident()}"
        with self.log.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"key": key, "receipt": receipt, **arguments}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return {"receipt": receipt}

    def compensate(self, arguments: Mapping[str, Any], result: Any) -> Any:
        self.undone.append(result)
        return {"refunded": result["receipt"]}

    def effects(self) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]


class LookingUp(Effects):
    """Effects, plus the lookup a downstream that deduplicates by key can offer."""

    def __init__(self, log: Path, answer: Callable[[str], Resolution | None] | None = None
                 ) -> None:
        super().__init__(log)
        self.answer = answer

    def lookup(self, key: str) -> Resolution | None:
        if self.answer is not None:
            return self.answer(key)
        found = [e for e in self.effects() if e["key"] == key]
        return Resolution.executed({"receipt": found[0]["receipt"]}) if found else None


def attempt(ledger: Ledger, tool: ToolExecutor, key: str = KEY, call: ToolCall = CALL,
            trace: str = "t1") -> CallOutcome:
    tracer = Tracer(trace)
    tracer.emit("tools", "tool.parsed", {"call_id": call.id, "name": call.name})
    return ToolBoundary({"transfer": tool}, policy=AllowAll(), ledger=ledger).process(
        call, tracer, key)


def kinds(tracer: Tracer) -> list[str]:
    return [e.event_type[5:] for e in tracer.events if e.event_type.startswith("tool.")]


def agree(outcomes: list[CallOutcome], tool: Effects, path: Path) -> None:
    """Exactly one effect; every caller got the recorded outcome of that one effect."""
    effects = tool.effects()
    assert len(effects) == 1, effects
    assert effects[0]["key"] == KEY  # the executor was given the idempotency key
    receipt = {"receipt": effects[0]["receipt"]}
    assert sorted(o.status for o in outcomes) == ["executed"] + ["reused"] * (len(outcomes) - 1)
    assert all(o.result == receipt and o.error is None for o in outcomes), outcomes
    assert [r["state"] for r in JsonlLedger(path).history()] == ["committed", "executed"]


def race(n: int, make_ledger: Callable[[int], Ledger], tool: Effects) -> list[CallOutcome]:
    """``n`` threads, released together, each retrying the same key."""
    start = threading.Barrier(n)
    outcomes: list[CallOutcome] = []
    errors: list[BaseException] = []

    def one(i: int) -> None:
        ledger = make_ledger(i)
        start.wait()
        try:
            outcomes.append(attempt(ledger, tool))
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    return outcomes


def test_twenty_threads_over_one_slow_ledger_file_execute_once(tmp_path: Path) -> None:
    """Half the threads share one ledger, half open their own on the same file (two
    pipelines in one process): the file lock, not the object, makes the claim atomic."""
    path = tmp_path / "ledger.jsonl"
    shared = SlowDisk(path)
    tool = Effects(tmp_path / "effects.jsonl")
    outcomes = race(20, lambda i: shared if i % 2 else SlowDisk(path), tool)
    agree(outcomes, tool, path)


def _process(path: str, log: str, out: str, start: Any) -> None:
    """One process of the cross-process race: ten threads, each with its own ledger."""
    try:
        tool = Effects(Path(log))
        start.wait()
        outcomes = race(10, lambda i: SlowDisk(path), tool)
        Path(out).write_text(json.dumps([[o.status, o.result, o.error] for o in outcomes]))
    except BaseException:
        Path(out).write_text(traceback.format_exc())
        raise


def test_two_processes_of_ten_threads_over_one_slow_ledger_file_execute_once(
        tmp_path: Path) -> None:
    path, log = tmp_path / "ledger.jsonl", tmp_path / "effects.jsonl"
    context = multiprocessing.get_context("fork")  # the parent's imports, at once
    start = context.Barrier(2)
    outs = [tmp_path / f"out{i}.json" for i in range(2)]
    processes = [context.Process(target=_process, args=(str(path), str(log), str(out), start))
                 for out in outs]
    for p in processes:
        p.start()
    for p in processes:
        p.join(60)
    assert [p.exitcode for p in processes] == [0, 0], [o.read_text() for o in outs
                                                       if o.exists()]
    outcomes = [CallOutcome(CALL, KEY, status, result, error)
                for out in outs for status, result, error in json.loads(out.read_text())]
    assert len(outcomes) == 20
    agree(outcomes, Effects(log), path)


@pytest.mark.parametrize("make", [MemoryLedger, lambda p: JsonlLedger(p)], ids=["memory",
                                                                              "jsonl"])
def test_the_claim_is_a_checked_check_and_set(make: Callable[..., Any], tmp_path: Path
                                              ) -> None:
    ledger = make() if make is MemoryLedger else make(tmp_path / "ledger.jsonl")
    committed = Entry(KEY, "committed", "call_1", "transfer", CALL.arguments)
    assert ledger.claim(committed) is None
    executed = Entry(KEY, "executed", "call_1", "transfer", CALL.arguments, {"receipt": 1})
    ledger.record(executed)
    assert ledger.claim(committed) == executed  # a second claim gets the record, runs nothing
    for wrong, says in ((committed, "committed once"), (executed, "recorded once"),
                        (Entry("k2", "failed", "c", "transfer", "{}", error="x"), "over a commit"),
                        (Entry("k2", "compensated", "c", "transfer", "{}"), "only an executed")):
        with pytest.raises(InvalidValueError, match=says):
            ledger.record(wrong)
    with pytest.raises(InvalidValueError, match="a claim records a commit"):
        ledger.claim(executed)
    with pytest.raises(ValueError):
        Entry(KEY, "rolled_back", "c", "transfer", "{}")


def test_a_second_ledger_on_the_file_reads_what_the_first_appended(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    first, second = JsonlLedger(path), JsonlLedger(path)
    tool = Effects(tmp_path / "effects.jsonl")
    assert attempt(first, tool).status == "executed"
    again = attempt(second, tool)  # opened before the first wrote anything
    assert again.status == "reused"
    assert again.result == {"receipt": tool.effects()[0]["receipt"]}
    assert len(tool.effects()) == 1


def test_a_claim_waits_for_a_live_holder_and_returns_its_outcome(tmp_path: Path) -> None:
    """While the claimant lives and works, another claim waits (it does not report the call
    in doubt); once the outcome is recorded, it returns that outcome."""
    path = tmp_path / "ledger.jsonl"
    holder, other = JsonlLedger(path), JsonlLedger(path)
    committed = Entry(KEY, "committed", "call_1", "transfer", CALL.arguments)
    assert holder.claim(committed) is None
    got: list[Entry | None] = []
    waiter = threading.Thread(target=lambda: got.append(other.claim(committed)))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and got == []  # correct code waits until the record below
    holder.record(Entry(KEY, "executed", "call_1", "transfer", CALL.arguments, 7))
    waiter.join(10)
    assert [g.state if g else None for g in got] == ["executed"] and got[0].result == 7


def _claim_and_die(path: str) -> None:
    ledger = JsonlLedger(path)
    ledger.claim(Entry(KEY, "committed", "call_1", "transfer", CALL.arguments))
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_dead_holder_leaves_its_call_in_doubt_and_resolve_settles_it(tmp_path: Path
                                                                         ) -> None:
    path = tmp_path / "ledger.jsonl"
    child = multiprocessing.get_context("fork").Process(target=_claim_and_die,
                                                        args=(str(path),))
    child.start()
    child.join(30)
    assert child.exitcode == -signal.SIGKILL
    tool = Effects(tmp_path / "effects.jsonl")
    ledger = JsonlLedger(path)
    doubtful = attempt(ledger, tool)  # the holder's lock died with it: no wait
    assert doubtful.status == "failed" and "in doubt" in str(doubtful.error)
    boundary = ToolBoundary({"transfer": tool}, policy=AllowAll(), ledger=ledger)
    settled = boundary.resolve(KEY, Resolution.executed({"receipt": "by hand"}))
    assert settled.resolved_by == "operator" and settled.state == "executed"
    retried = attempt(JsonlLedger(path), tool)
    assert (retried.status, retried.result) == ("reused", {"receipt": "by hand"})
    assert tool.effects() == []  # resolved, never executed
    with pytest.raises(InvalidValueError, match="no call in doubt"):
        boundary.resolve(KEY, Resolution.failed("twice"))
    with pytest.raises(InvalidValueError, match="no call in doubt"):
        boundary.resolve("never-committed", Resolution.failed("nothing"))
    assert [r["state"] for r in JsonlLedger(path).history()] == ["committed", "executed"]
    assert not any(JsonlLedger(path).inflight.iterdir())  # the dead holder's lock file went


def test_resolving_a_call_in_flight_waits_for_it_and_is_refused() -> None:
    ledger = MemoryLedger()
    assert ledger.claim(Entry(KEY, "committed", "c", "transfer", "{}")) is None
    refused: list[BaseException] = []

    def resolver() -> None:
        try:
            ToolBoundary({}, policy=AllowAll(), ledger=ledger).resolve(
                KEY, Resolution.failed("guess"))
        except InvalidValueError as exc:
            refused.append(exc)

    thread = threading.Thread(target=resolver)
    thread.start()
    thread.join(0.3)
    assert thread.is_alive()  # it waits while the holder works
    ledger.record(Entry(KEY, "executed", "c", "transfer", "{}", 1))
    thread.join(10)
    assert len(refused) == 1 and "executed" in str(refused[0])
    assert ledger.get(KEY) == Entry(KEY, "executed", "c", "transfer", "{}", 1)


def test_the_executors_lookup_settles_a_call_in_doubt(tmp_path: Path) -> None:
    ledger = MemoryLedger()
    ledger.record(Entry(KEY, "committed", "call_1", "transfer", CALL.arguments))
    log = tmp_path / "effects.jsonl"
    log.write_text(json.dumps({"key": KEY, "receipt": "r-9"}) + "\n")  # it did happen
    outcome = attempt(ledger, LookingUp(log))
    assert (outcome.status, outcome.result) == ("reused", {"receipt": "r-9"})
    assert ledger.get(KEY).resolved_by == "lookup"  # type: ignore[union-attr]
    for answer in (lambda key: None, lambda key: 1 // 0):  # cannot tell; a broken lookup
        other = MemoryLedger()
        other.record(Entry(KEY, "committed", "call_1", "transfer", CALL.arguments))
        still = attempt(other, LookingUp(log, answer))
        assert still.status == "failed" and "in doubt" in str(still.error)
        assert other.get(KEY).state == "committed"  # type: ignore[union-attr]
    said_no = MemoryLedger()
    said_no.record(Entry(KEY, "committed", "call_1", "transfer", CALL.arguments))
    never = attempt(said_no, LookingUp(log, lambda key: Resolution.failed("never ran")))
    assert (never.status, never.error) == ("reused", "never ran")


def test_the_executor_gets_the_key_and_plain_executors_keep_working(tmp_path: Path) -> None:
    tool = Effects(tmp_path / "effects.jsonl")
    assert isinstance(tool, KeyedExecutor) and isinstance(LookingUp(tmp_path), OutcomeLookup)
    attempt(MemoryLedger(), tool, key="the-key")
    assert [e["key"] for e in tool.effects()] == ["the-key"]
    seen: list[tuple[str, int]] = []

    def pay(to: str, amount: int) -> str:
        """Pay.

        Args:
            to: Whom.
            amount: How much.
        """
        seen.append((to, amount))
        return "paid"

    plain = FunctionTool(pay)
    assert not isinstance(plain, KeyedExecutor) and not isinstance(plain, OutcomeLookup)
    call = ToolCall("pay", '{"to": "bob", "amount": 5}', "c")
    tracer = Tracer("t")
    outcome = ToolBoundary({"pay": plain}, policy=AllowAll(), ledger=MemoryLedger()).process(
        call, tracer, "k")
    assert outcome.status == "executed" and seen == [("bob", 5)]


def test_a_compensation_is_its_own_record_and_a_retry_says_the_effect_was_undone(
        tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    tool = Effects(tmp_path / "effects.jsonl")
    boundary = ToolBoundary({"transfer": tool}, policy=AllowAll(), ledger=JsonlLedger(path))
    first = attempt(boundary.ledger, tool)
    undo = boundary.compensate(KEY, Tracer("t2"))
    assert undo == {"refunded": first.result["receipt"]}
    retry = attempt(JsonlLedger(path), tool)  # a restart, then a retry of the same call
    assert retry.status == "compensated" and retry.result == first.result
    assert retry.compensation == undo and retry.result != undo
    assert retry.content.startswith("compensated: the call executed and its effect was then "
                                    "undone")
    assert len(tool.effects()) == 1 and tool.undone == [first.result]
    reopened = JsonlLedger(path)
    assert reopened.get(KEY).state == "executed"  # type: ignore[union-attr]
    assert reopened.compensation(KEY).result == undo  # type: ignore[union-attr]
    assert [r["state"] for r in reopened.history()] == ["committed", "executed", "compensated"]


def test_an_interrupted_execution_releases_its_key_in_doubt(tmp_path: Path) -> None:
    """An executor interrupted by a BaseException records no outcome: its key is released,
    so the next attempt reports it in doubt at once instead of waiting forever."""

    class Interrupted(Effects):
        def execute_keyed(self, arguments: Mapping[str, Any], key: str) -> Any:
            raise KeyboardInterrupt

    for ledger in (MemoryLedger(), JsonlLedger(tmp_path / "ledger.jsonl")):
        with pytest.raises(KeyboardInterrupt):
            attempt(ledger, Interrupted(tmp_path / "effects.jsonl"))
        got: list[CallOutcome] = []
        thread = threading.Thread(target=lambda: got.append(
            attempt(ledger, Effects(tmp_path / "effects.jsonl"))))
        thread.start()
        thread.join(10)
        assert not thread.is_alive() and got[0].status == "failed"
        assert "in doubt" in str(got[0].error)


def test_resolutions_say_what_happened() -> None:
    assert Resolution.executed({"id": 1}) == Resolution("executed", {"id": 1})
    with pytest.raises(InvalidValueError):
        Resolution("failed")
    with pytest.raises(ValueError):
        Resolution("maybe")
    tracer = Tracer("t")
    ledger = MemoryLedger()
    ledger.record(Entry(KEY, "committed", "call_1", "transfer", CALL.arguments))
    boundary = ToolBoundary({}, policy=AllowAll(), ledger=ledger)
    boundary.resolve(KEY, Resolution.failed("it never ran"), tracer)
    assert tracer.events == ()  # not this trace's call: nothing is written into it
    assert ledger.get(KEY) == Entry(KEY, "failed", "call_1", "transfer", CALL.arguments,
                                    error="it never ran", resolved_by="operator")
