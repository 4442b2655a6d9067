"""Value types: validation at construction, unknown keys rejected, errors naming the field."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import attrs
import pytest

import pipeline
from pipeline import GenerationConfig, Message, Request, RuntimeLimits, ToolSpec
from pipeline.errors import InvalidValueError, PipelineError, UnknownFieldError


@pytest.mark.parametrize("field,value", [
    ("temperature", -1), ("top_p", 1.5), ("top_p", 0), ("max_tokens", 0), ("top_k", -3),
    ("min_p", 2.0), ("typical_p", 0.0), ("repetition_penalty", 0), ("presence_penalty", 3),
    ("frequency_penalty", -2.5), ("seed", -1), ("top_logprobs", 30), ("temperature", float("nan")),
    ("max_tokens", True), ("max_tokens", 2.5), ("stop", [""]), ("stop", ["x"] * 17),
    ("stop_token_ids", [-1]), ("allowed_token_ids", []), ("dry_multiplier", -0.1),
    ("dry_base", 0.5), ("dry_allowed_length", 0), ("dry_allowed_length", 1.5),
])
def test_bad_generation_values_name_field_and_value(field: str, value: object) -> None:
    with pytest.raises(InvalidValueError) as info:
        GenerationConfig(**{field: value})
    assert isinstance(info.value, PipelineError) and isinstance(info.value, ValueError)
    assert info.value.field.startswith(field) or field in str(info.value)
    if not isinstance(value, list):  # sequences name the offending element instead
        assert repr(value) in str(info.value)


def test_cross_field_rules() -> None:
    with pytest.raises(InvalidValueError, match="min_tokens"):
        GenerationConfig(max_tokens=4, min_tokens=5)
    with pytest.raises(InvalidValueError, match="top_logprobs"):
        GenerationConfig(top_logprobs=3)
    assert GenerationConfig(logprobs=True, top_logprobs=3).top_logprobs == 3


def test_logit_bias_keys_and_values_are_checked() -> None:
    cfg = GenerationConfig.from_dict({"logit_bias": {"42": 5, 7: -100}})
    assert dict(cfg.logit_bias) == {42: 5.0, 7: -100.0}
    with pytest.raises(InvalidValueError, match="logit_bias"):
        GenerationConfig(logit_bias={"abc": 1})
    with pytest.raises(InvalidValueError, match=r"logit_bias\[3\]"):
        GenerationConfig(logit_bias={3: 101})


def test_unknown_keys_are_rejected_not_dropped() -> None:
    with pytest.raises(UnknownFieldError) as info:
        GenerationConfig.from_dict({"temperature": 0.5, "temprature": 1})
    assert info.value.field == "temprature" and "temperature" in info.value.allowed
    with pytest.raises(UnknownFieldError):
        Message.from_dict({"role": "user", "content": "x", "extra": 1})
    with pytest.raises(UnknownFieldError):
        Request.from_dict({"messages": [{"role": "user", "content": "x"}], "nope": 1})
    with pytest.raises(UnknownFieldError):
        RuntimeLimits.from_dict({"deadline": 3})


def test_messages_and_requests() -> None:
    with pytest.raises(InvalidValueError, match="role"):
        Message("robot", "x")
    with pytest.raises(InvalidValueError, match="exactly one"):
        Request()
    with pytest.raises(InvalidValueError, match="exactly one"):
        Request(messages=[Message("user", "x")], prompt="y")
    r = Request.coerce("hello")
    assert r.messages == (Message("user", "hello"),) and r.request_id.startswith("req-")
    r2 = Request.coerce([{"role": "user", "content": "a"}], request_id="fixed")
    assert r2.request_id == "fixed" and r2.messages[0].content == "a"
    evolved = attrs.evolve(r2.generation_config, temperature=0)
    assert evolved.greedy
    tool = ToolSpec.from_dict({"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}}}})
    assert tool.to_template()["function"]["parameters"]["properties"]["x"]["type"] == "integer"
    with pytest.raises(InvalidValueError):
        RuntimeLimits(deadline_s=0)


def test_public_names_are_pinned() -> None:
    from pipeline.errors import PipelineError

    errors = sorted(name for name in pipeline.__all__
                    if isinstance(getattr(pipeline, name), type)
                    and issubclass(getattr(pipeline, name), BaseException))
    assert errors == sorted(pipeline.ERRORS)
    assert all(issubclass(getattr(pipeline, name), PipelineError) for name in errors)
    # one table: each name is exported from the module that defines it, not a re-export
    for name, home in pipeline._HOMES.items():
        value = getattr(pipeline, name)
        assert getattr(value, "__module__", home) == home or not isinstance(value, type), name
    for name in pipeline.__all__:
        assert getattr(pipeline, name).__doc__, name


def test_every_error_a_caller_may_catch_is_exported() -> None:
    # the library's exception classes (those not raised by the HTTP server only)
    import pipeline.errors as errors

    library = {name for name, value in vars(errors).items() if isinstance(value, type)
               and issubclass(value, errors.PipelineError)}
    assert library == set(pipeline.ERRORS)


ENGINE_HOOKS = {"Pipeline.job"}
"""Public methods that exist for the engine runtime, not for callers: their types are the
engine's own (``Job``, ``JobSpec``, ``Tracer``)."""


def test_the_types_the_public_signatures_name_are_exported() -> None:
    # walk the annotations of `build` and every exported class's public methods: each class of
    # the library's own modules they name (a strategy's Plan, Update, Taken; a backend's
    # ModelCall; what Pipeline.prepare returns; a Delta's parts) must be importable from
    # `pipeline` itself
    import inspect
    import typing

    def named(hint: Any) -> Iterator[type]:
        if isinstance(hint, type):
            yield hint
        for arg in typing.get_args(hint):
            yield from named(arg)

    def namespace(home: str) -> dict[str, Any]:
        # the module's names, and those its TYPE_CHECKING block imports from the library
        import pipeline.contracts.forcing  # noqa: F401
        import torch

        import threading
        from pathlib import Path

        import pipeline.tools.loop  # noqa: F401  (Pipeline.run's types)

        names: dict[str, Any] = {"torch": torch, "threading": threading, "Path": Path}
        for module_name, module in list(sys.modules.items()):
            if module_name.startswith("pipeline.") and module is not None:
                names.update({k: v for k, v in vars(module).items() if isinstance(v, type)
                              and getattr(v, "__module__", "") == module_name})
                names.update({k: v for k, v in vars(module).items()  # aliases: Tool, Ask
                              if typing.get_origin(v) is not None and k not in names})
        return {**names, **vars(sys.modules[home])}

    exported = {getattr(pipeline, name) for name in pipeline.__all__}
    missing = set()

    def check(where: str, member: Any) -> None:
        hints = typing.get_type_hints(member, namespace(member.__module__))
        for cls in (c for h in hints.values() for c in named(h)):
            home = getattr(cls, "__module__", "")
            if home.startswith("pipeline.") and cls not in exported \
                    and not home.startswith("pipeline.tools"):
                missing.add(f"{where}: {cls.__qualname__} ({home})")

    for name in pipeline.__all__:
        value = getattr(pipeline, name)
        if inspect.isfunction(value):
            check(name, value)
        if not isinstance(value, type) or issubclass(value, BaseException) \
                or not value.__module__.startswith("pipeline."):
            continue
        if attrs.has(value):
            check(name, value)  # the fields' annotations
        for attr, member in vars(value).items():
            member = member.fget if isinstance(member, property) else member
            member = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
            if attr.startswith("_") or not inspect.isfunction(member) \
                    or f"{name}.{attr}" in ENGINE_HOOKS:
                continue
            check(f"{name}.{attr}", member)
    assert not missing, "\n".join(sorted(missing))


def test_request_options_name_every_keyword_generate_takes() -> None:
    from pipeline.pipe import REQUEST_KEYWORDS
    from pipeline.request_options import RequestOptions

    fields = {f.name for f in attrs.fields(GenerationConfig)}
    own = set(REQUEST_KEYWORDS)
    assert set(RequestOptions.__annotations__) == fields | own


def test_a_planned_call_takes_every_field_of_its_plan() -> None:
    # ModelCall.planned is the one place a strategy's Plan becomes a backend's call: each field
    # the two share (every Plan field but its trace events) arrives as it is
    import torch

    from pipeline import Attention, ModelCall, Plan

    x = torch.ones(2, 3)
    plan = Plan((5, 6), (0, 1), Attention.BLOCK, False, embeddings=x, time=0.25,
                self_condition=x * 2)
    call = ModelCall.planned(3, 7, plan, (1, 2))
    shared = ({f.name for f in attrs.fields(Plan)} & {f.name for f in attrs.fields(ModelCall)})
    assert shared == {f.name for f in attrs.fields(Plan)} - {"events"}
    for name in shared:
        assert getattr(call, name) is getattr(plan, name), name
    assert (call.slot, call.start, call.blocks, call.prompt) == (3, 7, (1, 2), False)
