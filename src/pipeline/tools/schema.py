"""Typed Python callables as tools: JSON schemas from type hints and docstrings.

Owns :func:`tool_spec` (a function's :class:`~pipeline.contracts.request.ToolSpec`: its name, the summary
of its docstring, and a JSON schema of its parameters), :func:`schema_of` (one annotation as
a schema: ``str``, ``int``, ``float``, ``bool``, ``None``, ``list[...]``, ``dict[str, ...]``,
``X | None`` / ``Optional``, unions, ``Literal`` and enums) and :func:`python_arguments`
(validated JSON arguments back as the values the function's hints ask for). Descriptions of
parameters come from the docstring's ``Args:`` section (Google style). What cannot be
described (``*args``, a missing hint, an unsupported type) is an
:class:`~pipeline.errors.InvalidValueError` naming the function and the parameter.
"""

from __future__ import annotations

import enum
import inspect
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pipeline.errors import InvalidValueError
from pipeline.contracts.request import ToolSpec

_SIMPLE: Mapping[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean",
                              type(None): "null"}
_SECTION = re.compile(r"^(Args|Arguments|Parameters|Returns|Yields|Raises|Examples?|Notes?):\s*$")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_ARG = re.compile(r"^(\*{0,2}\w+)\s*(\([^)]*\))?\s*:\s*(.*)$")


def schema_of(annotation: Any, where: str) -> dict[str, Any]:
    """The JSON schema of a type annotation; ``where`` names it in errors."""
    if annotation in _SIMPLE:
        return {"type": _SIMPLE[annotation]}
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        values = [m.value for m in annotation]
        return {**_uniform(values), "enum": values}
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return {**_uniform(list(args)), "enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [schema_of(a, where) for a in args]}
    if annotation in (list, Sequence) or origin in (list, Sequence):
        return {"type": "array", **({"items": schema_of(args[0], where)} if args else {})}
    if annotation in (dict, Mapping) or origin in (dict, Mapping):
        if args and args[0] is not str:
            raise InvalidValueError(where, annotation, "JSON object keys are strings: use "
                                    "dict[str, ...]")
        return {"type": "object",
                **({"additionalProperties": schema_of(args[1], where)} if args else {})}
    raise InvalidValueError(where, annotation, "cannot be described as JSON: use str, int, "
                            "float, bool, list[...], dict[str, ...], Optional, Literal or "
                            "an Enum")


def _uniform(values: Sequence[Any]) -> dict[str, Any]:
    kinds = {_SIMPLE.get(type(v)) for v in values}
    return {"type": kinds.pop()} if len(kinds) == 1 and None not in kinds else {}


def docstring_parts(doc: str) -> tuple[str, dict[str, str]]:
    """The summary (text before the first section) and each ``Args:`` entry's description."""
    summary: list[str] = []
    described: dict[str, str] = {}
    section, current = None, None
    for line in inspect.cleandoc(doc).splitlines():
        header = _SECTION.match(line.strip())
        if header and not line.startswith((" ", "\t")):
            section, current = header.group(1), None
            continue
        if section is None:
            summary.append(line)
        elif section in ("Args", "Arguments", "Parameters") and line.strip():
            entry = _ARG.match(line.strip())
            if entry and _indent(line) <= 4:
                current = entry.group(1).lstrip("*")
                described[current] = entry.group(3).strip()
            elif current is not None:
                described[current] = (described[current] + " " + line.strip()).strip()
    return " ".join(" ".join(summary).split()), described


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def tool_spec(fn: Callable[..., Any]) -> ToolSpec:
    """The tool a typed function describes (name, docstring summary, parameter schema)."""
    name = getattr(fn, "__name__", type(fn).__name__)
    if not _NAME.fullmatch(name):
        raise InvalidValueError("tool", name, "a tool's name is 1-64 letters, digits, _ or - "
                                "(a lambda has none: define the function with def)")
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:  # a hint naming something undefined
        raise InvalidValueError(f"tool {name}", str(exc), "its type hints cannot be "
                                "resolved") from exc
    summary, described = docstring_parts(inspect.getdoc(fn) or "")
    properties: dict[str, Any] = {}
    required: list[str] = []
    for param in inspect.signature(fn).parameters.values():
        where = f"tool {name}, parameter {param.name}"
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise InvalidValueError(where, str(param), "*args and **kwargs cannot be described")
        if param.name not in hints:
            raise InvalidValueError(where, None, "needs a type annotation")
        schema = schema_of(hints[param.name], where)
        if param.name in described:
            schema["description"] = described[param.name]
        if param.default is param.empty:
            required.append(param.name)
        elif isinstance(param.default, (str, int, float, bool, enum.Enum)):
            default = param.default
            schema["default"] = default.value if isinstance(default, enum.Enum) else default
        properties[param.name] = schema
    return ToolSpec(name, summary, {"type": "object", "properties": properties,
                                    "required": required, "additionalProperties": False})


def python_arguments(fn: Callable[..., Any], arguments: Mapping[str, Any]) -> dict[str, Any]:
    """Validated JSON ``arguments`` as the function's hints want them (enum members for
    enum parameters, floats for float parameters given as integers)."""
    hints = typing.get_type_hints(fn)
    return {k: _python(hints.get(k, Any), v) for k, v in arguments.items()}


def _python(annotation: Any, value: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return annotation(value)
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        for option in args:
            if _fits(option, value):
                return _python(option, value)
        return value
    if origin in (list, Sequence) and args and isinstance(value, list):
        return [_python(args[0], v) for v in value]
    if origin in (dict, Mapping) and len(args) == 2 and isinstance(value, dict):
        return {k: _python(args[1], v) for k, v in value.items()}
    return value


def _fits(annotation: Any, value: Any) -> bool:
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return value in {m.value for m in annotation}
    return annotation is not type(None) or value is None
