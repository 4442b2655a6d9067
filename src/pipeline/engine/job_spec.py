"""What is fixed about a request in flight: its spec, plain data that crosses a process.

Owns :class:`JobSpec`, the first of a request's small records in the engine (docs/design.md §6,
second edition: spec, decode state, text state, trace). It holds the normalized
:class:`~pipeline.contracts.request.Request`, its :class:`~pipeline.contracts.text.TokenizedPrompt`, the seed and
the ids the stages need, and no stage object: the detokenizer and stoppers belong to the
text state (:mod:`pipeline.engine.text_state`), the strategy's loop state to the strategy, the
events to the tracer. So a spec can be written out and read back elsewhere, e.g. by an
engine in another process.

:meth:`JobSpec.to_dict` gives JSON-shaped data (mappings with string keys, lists, strings,
numbers, booleans, None) and :meth:`JobSpec.from_dict` reads it back, rejecting unknown and
missing keys; the round trip is exact (floats are written by ``repr``, so JSON keeps them
bit for bit). Free-form JSON values inside a request (``template_kwargs``, a tool's
``parameters``) come back as JSON values: a tuple in them comes back as a list. Pickling goes
through the same plain form (a request's read-only mappings cannot be pickled as they are).

Example::

    spec = JobSpec(request, prompt, seed=7, eos_token_ids=frozenset({2}),
                   accepted_ns=time.monotonic_ns())
    data = json.dumps(spec.to_dict())
    assert JobSpec.from_dict(json.loads(data)) == spec
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from pipeline.errors import InvalidValueError
from pipeline.contracts.request import Request, from_mapping
from pipeline.contracts.text import TokenizedPrompt


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not _int(value):
        raise InvalidValueError(attribute.name, value, "must be an integer")


def _token_set(value: Any) -> frozenset[int]:
    if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__iter__"):
        raise InvalidValueError("eos_token_ids", value, "must be a collection of token ids")
    ids = frozenset(value)
    for token in ids:
        if not _int(token) or token < 0:
            raise InvalidValueError("eos_token_ids", token, "token ids are non-negative integers")
    return ids


def _markers(value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    pair = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    if len(pair) != 2 or not all(_int(t) and t >= 0 for t in pair):
        raise InvalidValueError("think_markers", value,
                                "must be two token ids (begin and end of thinking) or None")
    return pair[0], pair[1]


def _optional_int(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not _int(value):
        raise InvalidValueError(attribute.name, value, "must be an integer or None")


@attrs.frozen
class JobSpec:
    """Everything fixed about a request when it is submitted; plain data only.

    ``seed`` is the request's effective seed; ``eos_token_ids`` the tokenizer's end ids;
    ``accepted_ns`` when the pipeline accepted it (``time.monotonic_ns``, which deadlines and
    queue limits count from); ``last_event`` the trace event the engine's first event follows
    (the tokenization event); ``think_markers`` the template's begin- and end-of-thinking ids
    when a reasoning budget is set; ``thinking`` whether the rendered prompt left a think
    block open, so the output starts as reasoning
    (:func:`~pipeline.output_parts.opens_thinking`).
    """

    request: Request = attrs.field(validator=attrs.validators.instance_of(Request))
    prompt: TokenizedPrompt = attrs.field(
        validator=attrs.validators.instance_of(TokenizedPrompt))
    seed: int = attrs.field(validator=_check_int)
    eos_token_ids: frozenset[int] = attrs.field(converter=_token_set)
    accepted_ns: int = attrs.field(validator=_check_int)
    last_event: int | None = attrs.field(default=None, validator=_optional_int)
    think_markers: tuple[int, int] | None = attrs.field(default=None, converter=_markers)
    thinking: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    def to_dict(self) -> dict[str, Any]:
        """This spec as JSON-shaped data (what :meth:`from_dict` reads)."""
        data: dict[str, Any] = plain(self)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobSpec:
        """Read :meth:`to_dict`'s form back; unknown or missing keys are an error."""
        required = [a.name for a in attrs.fields(cls) if a.default is attrs.NOTHING]
        missing = [name for name in required if isinstance(data, Mapping) and name not in data]
        if missing:
            raise InvalidValueError("JobSpec", sorted(data),
                                    f"missing field {missing[0]!r}")
        return from_mapping(cls, data, request=_read(Request.from_dict, "request"),
                            prompt=_read(_prompt_from_dict, "prompt"))

    def __reduce__(self) -> tuple[Callable[[Mapping[str, Any]], JobSpec], tuple[Any, ...]]:
        return JobSpec.from_dict, (self.to_dict(),)


def _prompt_from_dict(data: Mapping[str, Any]) -> TokenizedPrompt:
    return from_mapping(TokenizedPrompt, data)


def _read(build: Callable[[Mapping[str, Any]], Any], field: str) -> Callable[[Any], Any]:
    """A converter for a nested record: a mapping is built with ``build``, anything else is
    refused naming ``field``."""

    def convert(value: Any) -> Any:
        if not isinstance(value, Mapping):
            raise InvalidValueError(field, value, "must be a mapping")
        return build(value)

    return convert


def plain(value: Any) -> Any:
    """``value`` as JSON-shaped data: an attrs record as a mapping of its fields, an enum as
    its value, a mapping with string keys (an int key as its decimal text), a tuple, list or
    set as a list. What the types' ``from_dict`` constructors read back."""
    if attrs.has(type(value)):
        return {a.name: plain(getattr(value, a.name)) for a in attrs.fields(type(value))}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {_key(k): plain(v) for k, v in value.items()}
    if isinstance(value, (frozenset, set)):
        return sorted(plain(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float)):
        return value
    raise InvalidValueError("value", value, f"a {type(value).__name__} is not plain data")


def _key(key: Any) -> str:
    if isinstance(key, str):
        return key
    if _int(key):
        return str(key)
    raise InvalidValueError("key", key, "mapping keys must be strings or integers")
