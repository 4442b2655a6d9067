"""The in-process tool loop, and tool calls in the in-process API, on real engines.

The tiny model is made to call a tool by a forced prefix (its first tokens are the call, so
a call is certain); a scripted model answers once it has read the tool's result. Oracles:
``pipeline trace check`` on the JSON-lines traces the loop itself wrote (and on a corrupted
copy for each of invariants 7 and 8, which it must reject), a counting tool, and the
conversation the loop fed back, rendered by the model's own template.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from pipeline import build
from transports import cli
from pipeline.events import Event, JsonlSink, event_line, read_jsonl
from pipeline.testing import ByteTokenizer, ScriptedBackend, build_scripted, peaked
from pipeline.tools import Decision, Rules
from pipeline.trace.check import check

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


class Adder:
    """A counting tool: how often did the world change?"""

    def __init__(self, cancel: threading.Event | None = None) -> None:
        self.calls: list[tuple[int, int]] = []
        self.cancel = cancel

    def __call__(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first addend.
            b: The second addend.
        """
        self.calls.append((a, b))
        if self.cancel is not None:
            self.cancel.set()  # the user cancels while the write happens
        return a + b


def add_tool(adder: Adder) -> Any:
    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first addend.
            b: The second addend.
        """
        return adder(a, b)

    return add


@pytest.fixture()
def tiny(tmp_path: Path) -> Any:
    """The tiny model writing its traces to a JSON-lines file (complete once it is closed:
    call ``close()`` before reading the file)."""
    path = tmp_path / "trace.jsonl"
    with build("tiny", sinks=[JsonlSink(path)]) as pipe:
        tok = pipe.stages.tokenizer
        forced = tuple(tok.encode_text(CALL, special=True))
        yield pipe, forced, path


def options(forced: tuple[int, ...]) -> dict[str, Any]:
    return {"forced_prefix": forced, "max_tokens": len(forced) + 4, "temperature": 0}


def cli_check(path: Path, trace_id: str) -> int:
    return cli.main(["trace", "check", str(path), "--trace-id", trace_id])


def written(path: Path, trace_id: str) -> list[Event]:
    return [e for e in read_jsonl(path) if e.trace_id == trace_id]


def corrupt(events: Sequence[Event], path: Path, drop: str | None = None,
            rename: tuple[str, str] | None = None) -> Path:
    out = []
    for e in events:
        if e.event_type == drop:
            continue
        if rename is not None and e.event_type == rename[0]:
            e = Event(e.trace_id, e.event_id, e.parent_event_id, e.component, rename[1],
                      e.monotonic_ns, e.payload)
        out.append(e)
    path.write_text("".join(event_line(e) + "\n" for e in out))
    return path


def test_a_real_tool_loop_holds_invariants_7_and_8_and_corruptions_do_not(
        tiny: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pipe, forced, path = tiny
    adder = Adder()
    run = pipe.run("What is 2 + 3?", tools=[add_tool(adder)], max_rounds=1, **options(forced))
    pipe.close()
    assert adder.calls == [(2, 3)]
    assert run.stopped == "max_rounds" and [o.status for o in run.calls] == ["executed",
                                                                             "skipped"]
    executed = run.rounds[0]
    trace_id = executed.completion.request_id
    events = written(path, trace_id)
    assert [e.event_type[5:] for e in events if e.event_type.startswith("tool.")] == [
        "proposed", "parsed", "validated", "authorized", "committed", "executed"]
    assert [(e.event_id, e.event_type) for e in events] == [  # the file holds the run's trace
        (e.event_id, e.event_type) for e in executed.trace]
    for round_ in run.rounds:
        assert cli_check(path, round_.completion.request_id) == 0, capsys.readouterr().out
    bad7 = corrupt(events, tmp_path / "denied-yet-run.jsonl",
                   rename=("tool.authorized", "tool.denied"))
    assert cli_check(bad7, trace_id) == 1
    assert "executed before it was authorized" in capsys.readouterr().out
    assert check(read_jsonl(bad7)).violated == {7}
    bad8 = corrupt(events, tmp_path / "no-outcome.jsonl", drop="tool.executed")
    assert cli_check(bad8, trace_id) == 1
    assert "outcome is missing" in capsys.readouterr().out
    assert check(read_jsonl(bad8)).violated == {8}


def test_a_cancel_during_the_write_is_recorded_after_its_outcome(tiny: Any, tmp_path: Path
                                                                 ) -> None:
    pipe, forced, path = tiny
    cancel = threading.Event()
    adder = Adder(cancel)
    run = pipe.run("What is 2 + 3?", tools=[add_tool(adder)], max_rounds=3, cancel=cancel,
                   **options(forced))
    pipe.close()
    assert run.stopped == "cancelled" and len(run.rounds) == 1 and adder.calls == [(2, 3)]
    trace_id = run.rounds[0].completion.request_id
    events = written(path, trace_id)
    tools = [e.event_type[5:] for e in events if e.event_type.startswith("tool.")]
    assert tools[-2:] == ["executed", "cancel_after_commit"]
    assert cli_check(path, trace_id) == 0
    rolled_back = corrupt(events, tmp_path / "rolled-back.jsonl",
                          rename=("tool.cancel_after_commit", "tool.rolled_back"))
    assert cli_check(rolled_back, trace_id) == 1
    assert check(read_jsonl(rolled_back)).violated == {8}


def test_rerunning_a_run_with_its_ledger_never_repeats_an_effect(tiny: Any, tmp_path: Path
                                                                 ) -> None:
    pipe, forced, _ = tiny
    adder = Adder()
    ledger = tmp_path / "ledger.jsonl"
    first = pipe.run("What is 2 + 3?", tools=[add_tool(adder)], max_rounds=1, ledger=ledger,
                     run_id="run-1", **options(forced))
    again = pipe.run("What is 2 + 3?", tools=[add_tool(adder)], max_rounds=1, ledger=ledger,
                     run_id="run-1", **options(forced))
    assert adder.calls == [(2, 3)]
    assert (first.calls[0].status, again.calls[0].status) == ("executed", "reused")
    assert again.calls[0].result == 5 and again.messages[2].content == "5"
    assert "tool.reused" in [e.event_type for e in again.rounds[0].trace]


def test_a_denying_policy_is_told_to_the_model_and_traced(tiny: Any) -> None:
    pipe, forced, _ = tiny
    adder = Adder()
    run = pipe.run("What is 2 + 3?", tools=[add_tool(adder)], max_rounds=1,
                   policy=Rules({"add": Decision.DENY}), **options(forced))
    assert adder.calls == [] and run.calls[0].status == "denied"
    tool_message = run.messages[2]
    assert tool_message.role == "tool" and tool_message.content.startswith("denied")
    types = [e.event_type for e in run.rounds[0].trace]
    assert "tool.denied" in types and "tool.committed" not in types
    assert check(list(run.rounds[0].trace)).ok
    # the denial reached the model: round two's prompt, rendered by the template, holds it
    rendered = pipe.render(list(run.messages[:3]), tools=[{"name": "add"}]).text
    assert "<tool_response>\ndenied: rule for add\n</tool_response>" in rendered


def scripted_answerer() -> ScriptedBackend:
    """A model that calls ``add`` and, once it has read a tool's result, answers with it."""
    vocab = ByteTokenizer.VOCAB
    eos, im_start = 256, 257

    def choose(ids: Sequence[int]) -> int:
        start = len(ids) - 1 - list(reversed(ids)).index(im_start)
        prompt = bytes(i for i in ids[:start] if i < 256).decode()
        said = bytes(i for i in ids[start + 1:] if i < 256).decode()[len("assistant\n"):]
        result = prompt.rsplit("tool\n", 1)[1].split("<")[0] if "tool\n" in prompt else None
        target = CALL if result is None else f"It is {result.strip()}."
        return ord(target[len(said)]) if len(said) < len(target) else eos

    return ScriptedBackend(vocab, peaked(vocab, choose))


def test_the_model_answers_with_the_result_and_the_loop_stops() -> None:
    adder = Adder()
    with build_scripted(scripted_answerer()) as pipe:
        run = pipe.run([{"role": "user", "content": "2 + 3?"}], tools=[add_tool(adder)],
                       max_rounds=3, max_tokens=120, temperature=0)
    assert run.stopped == "answered" and adder.calls == [(2, 3)]
    assert run.completion.text == "It is 5." and run.completion.tool_calls == ()
    assert [m.role for m in run.messages] == ["user", "assistant", "tool", "assistant"]
    assert run.messages[1].tool_calls[0].name == "add" and run.messages[1].content is None
    assert all(check(list(r.trace)).ok for r in run.rounds)


def test_in_process_generate_and_stream_give_the_calls(tiny: Any) -> None:
    pipe, forced, _ = tiny
    tools = [{"name": "add", "parameters": {"type": "object"}}]
    done = pipe.generate("What is 2 + 3?", tools=tools, **options(forced))
    assert [(c.name, json.loads(c.arguments)) for c in done.tool_calls] == [("add",
                                                                            {"a": 2, "b": 3})]
    deltas = list(pipe.stream("What is 2 + 3?", tools=tools, **options(forced)))
    pieces = [p for d in deltas for p in d.tool_calls]
    assert pieces[0].name == "add" and len(pieces) > 2  # the arguments came in fragments
    assert "".join(p.arguments for p in pieces) == done.tool_calls[0].arguments
    assert "".join(d.text for d in deltas) == done.text  # the text is still all of it
    plain = pipe.generate("What is 2 + 3?", **options(forced))
    assert plain.tool_calls == () and "tool.proposed" not in [e.event_type
                                                              for e in plain.trace]


def test_bad_loop_arguments_are_refused_by_name(tiny: Any) -> None:
    pipe, _, _ = tiny
    from pipeline.errors import InvalidValueError, UnknownNameError

    def add(a: int, b: int) -> int:
        return a + b

    with pytest.raises(InvalidValueError, match="tools"):
        pipe.run("hi", tools=[])
    with pytest.raises(InvalidValueError, match="max_rounds"):
        pipe.run("hi", tools=[add], max_rounds=-1)
    with pytest.raises(InvalidValueError, match="two tools have this name"):
        pipe.run("hi", tools=[add, add])
    with pytest.raises(UnknownNameError):
        pipe.run("hi", tools=["no_such_tool"])
    with pytest.raises(InvalidValueError, match="policy"):
        pipe.run("hi", tools=[add], policy=object())
    with pytest.raises(InvalidValueError, match="lambda"):
        pipe.run("hi", tools=[lambda a: a])


def test_trace_diff_compares_what_tools_did_not_which_run_did_it(tiny: Any) -> None:
    """Two runs of the same loop differ in request ids, call ids and idempotency keys only:
    no divergence; a tool that returns something else diverges at the external effect."""
    from pipeline.trace.diff import diff

    pipe, forced, _ = tiny

    class Wrong(Adder):
        def __call__(self, a: int, b: int) -> int:
            return a * b

    runs = [pipe.run("What is 2 + 3?", tools=[add_tool(adder)], max_rounds=1,
                     **options(forced)) for adder in (Adder(), Adder(), Wrong())]
    assert runs[0].rounds[0].outcomes[0].key != runs[1].rounds[0].outcomes[0].key
    same = diff(runs[0].rounds[0].trace, runs[1].rounds[0].trace)
    assert same.divergence is None, same.render()
    other = diff(runs[0].rounds[0].trace, runs[2].rounds[0].trace).divergence
    assert other is not None and other.product == "external effect"


def test_executors_and_policies_registered_by_plugins_are_used_by_name() -> None:
    from pipeline import Component, ToolSpec, hookimpl
    from pipeline.tools import AllowAll

    touched: list[dict[str, Any]] = []

    class Clock:
        spec = ToolSpec("clock", "The time in a city.", {
            "type": "object", "properties": {"city": {"type": "string"}},
            "required": ["city"]})

        def execute(self, arguments: Any) -> Any:
            touched.append(dict(arguments))
            return {"time": "12:00"}

        def compensate(self, arguments: Any, result: Any) -> Any:
            raise NotImplementedError

    class Plugin:
        @hookimpl
        def pipeline_components(self) -> list[Component]:
            return [Component("tool", "clock", lambda ctx: Clock(), "the time"),
                    Component("tool_policy", "open", lambda ctx: AllowAll(), "allow all")]

    text = '<tool_call>\n{"name": "clock", "arguments": {"city": "Oslo"}}\n</tool_call>'
    with build("tiny", plugins=[Plugin()]) as pipe:
        forced = tuple(pipe.stages.tokenizer.encode_text(text, special=True))
        run = pipe.run("Time in Oslo?", tools=["clock"], policy="open", max_rounds=1,
                       **options(forced))
    assert touched == [{"city": "Oslo"}] and run.calls[0].content == '{"time": "12:00"}'
    authorized = next(e for e in run.rounds[0].trace if e.event_type == "tool.authorized")
    assert authorized.payload["policy"] == "allow_all"
