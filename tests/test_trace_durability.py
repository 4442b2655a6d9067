"""Traces that survive a crash: SIGKILL at every point of a tool call's lifecycle.

A real generation (a scripted model that calls ``add``) writes its trace to a JSON-lines
file; then a child process takes the call across the boundary with that trace resumed and
kills itself with SIGKILL at one chosen point, through an injected hook: a sink after the
file's own (the event is written, then the process dies), a ledger whose durable write is
followed by the kill (the ledger holds a record the trace does not yet), or the executor
itself (the effect happened, nothing recorded it). A second child restarts and retries and
is killed at the same point again where it gets that far; then a restart in this process
recovers, resolves what is in doubt, and retries.

Oracles, independent of one another: the executor's effect log (fsynced before the executor
returns), the ledger file, and ``pipeline trace check`` on the trace file. They must agree:
exactly as many effects as executed outcomes, the same result everywhere, and a trace that
passes every invariant.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from pipeline.errors import InvalidValueError
from pipeline.events import DURABILITY, Event, JsonlSink, Tracer, read_jsonl
from pipeline.testing import ByteTokenizer, ScriptedBackend, build_scripted, peaked
from pipeline.tools import AllowAll, JsonlLedger, Resolution, ToolBoundary, tool_spec
from pipeline.trace.check import check
from pipeline.contracts.request import ToolCall

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
KEY = "run-1/round-0/call-0"


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first addend.
        b: The second addend.
    """
    return a + b


def caller() -> ScriptedBackend:
    """A model that answers with the one tool call."""
    vocab = ByteTokenizer.VOCAB
    eos, im_start = 256, 257

    def choose(ids: Sequence[int]) -> int:
        start = len(ids) - 1 - list(reversed(ids)).index(im_start)
        said = bytes(i for i in ids[start + 1:] if i < 256).decode()[len("assistant\n"):]
        return ord(CALL[len(said)]) if len(said) < len(CALL) else eos

    return ScriptedBackend(vocab, peaked(vocab, choose))


@pytest.fixture(scope="module")
def generation(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, ToolCall]:
    """A trace file holding one finished generation that called ``add``; its trace id and
    the call."""
    path = tmp_path_factory.mktemp("generation") / "trace.jsonl"
    with build_scripted(caller(), sinks=[JsonlSink(path)]) as pipe:
        done = pipe.generate([{"role": "user", "content": "2 + 3?"}],
                             tools=[tool_spec(add).to_template()["function"]],
                             max_tokens=len(CALL) + 4, temperature=0)
    assert [(c.name, json.loads(c.arguments)) for c in done.tool_calls] == [
        ("add", {"a": 2, "b": 3})]
    assert check(path, trace_id=done.request_id).ok
    return path, done.request_id, done.tool_calls[0]


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class KillAfter:
    """A sink placed after the file's: the event is on file, then the process dies."""

    def __init__(self, event_type: str | None) -> None:
        self.event_type = event_type

    def emit(self, event: Event) -> None:
        if event.event_type == self.event_type:
            die()

    def close(self) -> None:
        """Nothing to flush."""


class KillingLedger(JsonlLedger):
    """Dies right after a record of ``state`` is durable, before anything else learns of it."""

    def __init__(self, path: Path, state: str | None) -> None:
        self.state = state
        super().__init__(path)

    def write_record(self, line: bytes) -> None:
        super().write_record(line)
        if json.loads(line)["state"] == self.state:
            die()


class Adder:
    """The effect is a line in a log (with the key it ran under), fsynced before returning;
    ``kill`` dies between the effect and its return."""

    def __init__(self, log: Path, kill: bool = False) -> None:
        self.log, self.kill = log, kill
        self.spec = tool_spec(add)

    def execute(self, arguments: Any) -> Any:
        raise AssertionError("the boundary passes the key to a keyed executor")

    def execute_keyed(self, arguments: Any, key: str) -> Any:
        result = arguments["a"] + arguments["b"]
        with self.log.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"key": key, "result": result}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self.kill:
            die()
        return result

    def compensate(self, arguments: Any, result: Any) -> Any:
        raise NotImplementedError

    def effects(self) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]


class LookingAdder(Adder):
    """An adder whose downstream can say what happened under a key (its effect log)."""

    def lookup(self, key: str) -> Resolution | None:
        found = [e for e in self.effects() if e["key"] == key]
        return Resolution.executed(found[0]["result"]) if found else None


POINTS = {  # where the child dies: (hook, argument)
    "after validated": ("sink", "tool.validated"),
    "after authorized": ("sink", "tool.authorized"),
    "ledger committed, trace not yet": ("ledger", "committed"),
    "after committed, before execute": ("sink", "tool.committed"),
    "during execute": ("executor", None),
    "ledger executed, trace not yet": ("ledger", "executed"),
    "after executed": ("sink", "tool.executed"),
}
IN_DOUBT = {"ledger committed, trace not yet", "after committed, before execute",
            "during execute"}
"""Where the process dies holding a commit with no outcome."""


def resumed(path: Path, trace_id: str, sinks: Sequence[Any]) -> Tracer:
    """The trace as a restarted process finds it, going on into ``sinks``."""
    return Tracer.resume([e for e in read_jsonl(path) if e.trace_id == trace_id], sinks)


def _child(folder: Path, trace_id: str, call: ToolCall, point: str | None,
           durability: str, lookup: bool) -> None:
    """A process that takes the call across the boundary and is killed at ``point``."""
    try:
        hook, argument = POINTS[point] if point is not None else ("none", None)
        sink = JsonlSink(folder / "trace.jsonl", durability=durability)  # mends a torn tail
        tracer = resumed(folder / "trace.jsonl", trace_id,
                         [sink, KillAfter(argument if hook == "sink" else None)])
        ledger = KillingLedger(folder / "ledger.jsonl", argument if hook == "ledger" else None)
        kind = LookingAdder if lookup else Adder
        tool = kind(folder / "effects.jsonl", kill=hook == "executor")
        ToolBoundary({"add": tool}, policy=AllowAll(), ledger=ledger).process(call, tracer, KEY)
        sink.close()
    except BaseException:
        (folder / "child-error.txt").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def run_child(folder: Path, trace_id: str, call: ToolCall, point: str | None,
              durability: str = "fsync-boundary", lookup: bool = False) -> int:
    """Run one child; its exit code (negative: the signal that ended it)."""
    child = multiprocessing.get_context("fork").Process(
        target=_child, args=(folder, trace_id, call, point, durability, lookup))
    child.start()
    child.join(60)
    error = folder / "child-error.txt"
    assert not error.exists(), error.read_text()
    assert child.exitcode is not None
    return child.exitcode


def crashed(tmp_path: Path, generation: tuple[Path, str, ToolCall], point: str,
            durability: str = "fsync-boundary", lookup: bool = False) -> Path:
    source, trace_id, call = generation
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "trace.jsonl").write_bytes(source.read_bytes())
    assert run_child(tmp_path, trace_id, call, point, durability, lookup) == -signal.SIGKILL
    return tmp_path


def tool_events(path: Path, trace_id: str) -> list[str]:
    return [e.event_type[5:] for e in read_jsonl(path) if e.trace_id == trace_id
            and e.event_type.startswith("tool.") and e.event_type not in ("tool.proposed",
                                                                          "tool.parsed")]


def states(folder: Path) -> list[str]:
    return [r["state"] for r in JsonlLedger(folder / "ledger.jsonl").history()]


def test_a_killed_process_leaves_a_trace_that_agrees_with_the_ledger(
        tmp_path: Path, generation: tuple[Path, str, ToolCall]) -> None:
    """Right after each kill, before any restart: every boundary event emitted before the
    kill is on file, so the trace shows exactly the transitions the ledger shows (one step
    behind only where the kill fell between a ledger write and its event)."""
    _, trace_id, _ = generation
    expected = {
        "after validated": (["validated"], []),
        "after authorized": (["validated", "authorized"], []),
        "ledger committed, trace not yet": (["validated", "authorized"], ["committed"]),
        "after committed, before execute": (["validated", "authorized", "committed"],
                                            ["committed"]),
        "during execute": (["validated", "authorized", "committed"], ["committed"]),
        "ledger executed, trace not yet": (["validated", "authorized", "committed"],
                                           ["committed", "executed"]),
        "after executed": (["validated", "authorized", "committed", "executed"],
                           ["committed", "executed"]),
    }
    for number, point in enumerate(POINTS):
        folder = crashed(tmp_path / str(number), generation, point)
        assert (tool_events(folder / "trace.jsonl", trace_id), states(folder)) == \
            expected[point], point
        effects = Adder(folder / "effects.jsonl").effects()
        assert len(effects) == (point in ("during execute", "ledger executed, trace not yet",
                                          "after executed")), point
        report = check(folder / "trace.jsonl", trace_id=trace_id)
        # a commit on file with no outcome is what the checker must flag (the restart below
        # brings the trace level with the ledger)
        on_file = expected[point][0]
        assert report.violated == ({8} if on_file[-1] == "committed" else set()), (
            point, report.render())


def test_without_durability_the_killed_trace_misses_the_commit(
        tmp_path: Path, generation: tuple[Path, str, ToolCall]) -> None:
    """The oracle above can tell: a buffered sink loses the boundary's events when the
    process is killed, while the ledger holds the commit (the failure this file guards)."""
    _, trace_id, _ = generation
    folder = crashed(tmp_path, generation, "after committed, before execute", "none")
    assert states(folder) == ["committed"]
    assert tool_events(folder / "trace.jsonl", trace_id) == []


@pytest.mark.parametrize("point", list(POINTS))
def test_after_a_kill_at_each_point_and_a_restart_everything_agrees(
        point: str, tmp_path: Path, generation: tuple[Path, str, ToolCall]) -> None:
    _, trace_id, call = generation
    folder = crashed(tmp_path, generation, point)
    # a restart that retries and is killed at the same point again, if it gets there
    assert run_child(folder, trace_id, call, point) in (0, -signal.SIGKILL)
    effects_before = Adder(folder / "effects.jsonl").effects()

    sink = JsonlSink(folder / "trace.jsonl")
    tracer = resumed(folder / "trace.jsonl", trace_id, [sink])
    tool = Adder(folder / "effects.jsonl")
    boundary = ToolBoundary({"add": tool}, policy=AllowAll(),
                            ledger=JsonlLedger(folder / "ledger.jsonl"))
    doubtful = boundary.recover(tracer)
    assert doubtful == ((KEY,) if point in IN_DOUBT else ()), point
    for key in doubtful:  # the operator looks downstream: did it happen?
        done = [e for e in tool.effects() if e["key"] == key]
        boundary.resolve(key, Resolution.executed(done[0]["result"]) if done else
                         Resolution.failed("never ran: the effect log has no entry"), tracer)
    retry = boundary.process(call, tracer, KEY)
    sink.close()

    effects = tool.effects()
    ledger = JsonlLedger(folder / "ledger.jsonl").get(KEY)
    assert ledger is not None
    assert len(effects) <= 1 and effects[:len(effects_before)] == effects_before
    if point in ("after validated", "after authorized"):  # nothing crossed: it runs now
        assert retry.status == "executed" and len(effects_before) == 0
    else:  # the retry never ran the call again: it returns what the ledger holds
        assert retry.status == "reused" and effects == effects_before
    executed = ledger.state == "executed"
    assert len(effects) == int(executed) and all(e["key"] == KEY for e in effects)
    assert (retry.result, retry.error) == (ledger.result, ledger.error)
    if executed:
        assert ledger.result == effects[0]["result"] == 5
    events = tool_events(folder / "trace.jsonl", trace_id)
    assert events.count("executed") == int(executed)
    assert events.count("failed") == int(ledger.state == "failed")
    assert events.count("committed") == 1
    report = check(folder / "trace.jsonl", trace_id=trace_id)
    assert report.ok, report.render()
    assert boundary.recover(resumed(folder / "trace.jsonl", trace_id, [])) == ()


def test_the_executors_lookup_settles_a_kill_during_execute(
        tmp_path: Path, generation: tuple[Path, str, ToolCall]) -> None:
    _, trace_id, call = generation
    folder = crashed(tmp_path, generation, "during execute", lookup=True)
    sink = JsonlSink(folder / "trace.jsonl")
    tracer = resumed(folder / "trace.jsonl", trace_id, [sink])
    tool = LookingAdder(folder / "effects.jsonl")
    boundary = ToolBoundary({"add": tool}, policy=AllowAll(),
                            ledger=JsonlLedger(folder / "ledger.jsonl"))
    assert boundary.recover(tracer) == ()  # the downstream knew: nothing left in doubt
    retry = boundary.process(call, tracer, KEY)
    sink.close()
    assert (retry.status, retry.result) == ("reused", 5) and len(tool.effects()) == 1
    record = JsonlLedger(folder / "ledger.jsonl").get(KEY)
    assert record is not None and record.resolved_by == "lookup"
    assert check(folder / "trace.jsonl", trace_id=trace_id).ok
    executed = [e for e in read_jsonl(folder / "trace.jsonl")
                if e.trace_id == trace_id and e.event_type == "tool.executed"]
    assert [(e.payload["recovered"], e.payload["resolved_by"]) for e in executed] == [
        (True, "lookup")]


def test_a_sink_mends_a_torn_last_line_and_checks_its_level(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    whole = '{"trace_id": "t", "event_id": 1}'
    path.write_text(whole + "\n" + '{"trace_id": "t", "ev')  # a writer died mid-line
    JsonlSink(path).close()
    assert path.read_text() == whole + "\n"
    path.write_text(whole)  # whole but for its newline: finished, not cut
    JsonlSink(path).close()
    assert path.read_text() == whole + "\n"
    for level in DURABILITY:
        sink = JsonlSink(tmp_path / f"{level}.jsonl", durability=level)
        tracer = Tracer("t", [sink])
        tracer.emit("engine", "request.accepted", {})
        tracer.emit("tools", "tool.committed", {"call_id": "c", "name": "add"})
        sink.close()
        assert [e.event_type for e in read_jsonl(tmp_path / f"{level}.jsonl")] == [
            "request.accepted", "tool.committed"]
    with pytest.raises(InvalidValueError, match="durability"):
        JsonlSink(tmp_path / "x.jsonl", durability="sometimes")
