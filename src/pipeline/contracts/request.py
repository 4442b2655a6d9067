"""The request side of the contracts: what a caller asks for (docs/design.md §3).

:class:`Request` and what it holds (:class:`Message`, :class:`ToolSpec`, :class:`ToolChoice`,
:class:`GenerationConfig`, :class:`RuntimeLimits`), and the checks every value type uses. Every
type is ``@attrs.frozen`` and validated when it is built; change one with ``attrs.evolve``.
Building from a mapping (``from_dict``) rejects unknown keys with
:class:`~pipeline.errors.UnknownFieldError`; a value outside its domain raises
:class:`~pipeline.errors.InvalidValueError` naming the field and the value. Wire formats (JSON
bodies, SSE) live in the transports, not here.
"""

from __future__ import annotations

import enum
import functools
import json
import math
import uuid
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, TypeVar

import attrs

from pipeline.errors import InvalidValueError, UnknownFieldError
from pipeline.grammar import Grammar, grammar_value

SCHEMA_VERSION = 1
"""Version of the ``Request`` schema; recorded in every trace."""

T = TypeVar("T")
JSON = Any  # a value that ``json.dumps`` accepts


# --- validators ---------------------------------------------------------------------------


def _check(ok: bool, field: str, value: object, reason: str) -> None:
    if not ok:
        raise InvalidValueError(field, value, reason)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _range(
    lo: float | None, hi: float | None, *, lo_open: bool = False, integer: bool = False
) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    """An attrs validator: the value is a finite number (an int if ``integer``) within bounds."""

    def validate(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        name = attribute.name
        _check(_integer(value) if integer else _number(value), name, value,
               "must be an integer" if integer else "must be a finite number")
        if lo is not None:
            ok = value > lo if lo_open else value >= lo
            _check(ok, name, value, f"must be {'>' if lo_open else '>='} {lo}")
        if hi is not None:
            _check(value <= hi, name, value, f"must be <= {hi}")

    return validate


MAX_COUNT = 1 << 30
"""Upper bound of every count a request names (``max_tokens``, ``top_k``, ...): beyond it a
value can only be a mistake or an attack, and it keeps every count a 32-bit integer."""
DEFAULT_MAX_TOKENS = 512
"""The ``max_tokens`` of a request that names none, the same in ``build()``, the command line,
the chat page and the HTTP server (docs/quickstart.md, "Sampling and the generation config": the default
model's answers to everyday prompts that end by themselves stay far below it, and a run that
does not end stops within about a minute on a CPU)."""
MAX_STOP = 16
"""Most stop strings one request may give."""
MAX_SECONDS = 1e9
"""Upper bound of every duration (about 31 years): a longer one is a mistake, and beyond it
nanosecond arithmetic leaves the range of integers a clock can hold."""
GREEDY_BELOW = 1e-5
"""A temperature below this is greedy: dividing logits by a smaller one overflows float32 (for
``1e-320`` it is a division by zero), and the distribution is an argmax there anyway."""


def unicode_error(value: str) -> str | None:
    """Why ``value`` is not valid Unicode text (a lone UTF-16 surrogate), or None."""
    if value.isascii():
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (f"is not valid Unicode: lone surrogate U+{ord(value[exc.start]):04X} at "
                f"index {exc.start}")
    return None


def check_text(field: str, value: Any) -> None:
    """Raise :class:`InvalidValueError` unless ``value`` is None or valid Unicode text."""
    if isinstance(value, str):
        why = unicode_error(value)
        if why is not None:
            raise InvalidValueError(field, value, why)


def check_json_text(field: str, value: Any) -> None:
    """Every string (keys too) inside a JSON-like value is valid Unicode (iterative, so a
    deeply nested value cannot exhaust the stack)."""
    stack: list[tuple[str, Any]] = [(field, value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            check_text(path, item)
        elif isinstance(item, Mapping):
            for key, sub in item.items():
                check_text(f"{path} key", key)
                stack.append((f"{path}.{key}", sub))
        elif isinstance(item, (list, tuple)):
            stack.extend((f"{path}[{i}]", sub) for i, sub in enumerate(item))


def _text(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """An attrs validator: None, or a string that is valid Unicode."""
    _check(value is None or isinstance(value, str), attribute.name, value, "must be a string")
    check_text(attribute.name, value)


def _token_ids(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    for token in value:
        _check(_integer(token) and token >= 0, attribute.name, token,
               "token ids are non-negative integers")


def _tuple_of_ints(value: Any) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, (list, tuple, set, frozenset)) else value


def _stop_strings(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _frozen_mapping(value: Any) -> Mapping[Any, Any]:
    if isinstance(value, Mapping):
        return MappingProxyType(dict(value))
    return value  # type: ignore[no-any-return]


def from_mapping(cls: type[T], data: Mapping[str, Any], **convert: Callable[[Any], Any]) -> T:
    """Build ``cls`` from ``data``, rejecting keys it lacks; ``convert`` maps a field's raw value."""
    if not isinstance(data, Mapping):
        raise InvalidValueError(cls.__name__, data, "must be a mapping")
    names = {a.name for a in attrs.fields(cls)}  # type: ignore[arg-type]
    for key in data:
        if key not in names:
            raise UnknownFieldError(cls.__name__, str(key), names)
    kwargs = {k: (convert[k](v) if k in convert else v) for k, v in data.items()}
    return cls(**kwargs)


# --- messages and tools -------------------------------------------------------------------

ROLES = ("system", "developer", "user", "assistant", "tool")


@attrs.frozen
class ToolCall:
    """A tool call the assistant proposed: ``arguments`` is the JSON text it emitted."""

    name: str = attrs.field(validator=[attrs.validators.instance_of(str), _text])
    arguments: str = attrs.field(default="{}", validator=[attrs.validators.instance_of(str),
                                                          _text])
    id: str | None = attrs.field(default=None, validator=_text)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ToolCall:
        """Build from ``{"name", "arguments", "id"}``, or from the OpenAI / Hugging Face
        shape ``{"id", "type": "function", "function": {"name", "arguments"}}``; ``arguments``
        may be JSON text or a mapping (written as a chat template's ``tojson`` writes it, so
        templates render it as transformers does)."""
        if isinstance(data, Mapping) and "function" in data:
            kind = data.get("type", "function")
            _check(kind == "function", "tool_calls.type", kind, "only function calls exist")
            extra = set(data) - {"id", "type", "function"}
            if extra:
                raise UnknownFieldError("ToolCall", sorted(extra)[0], ("id", "type", "function"))
            function = data["function"]
            _check(isinstance(function, Mapping), "tool_calls.function", function,
                   "must be a mapping with name and arguments")
            data = {**function, **({"id": data["id"]} if data.get("id") is not None else {})}
        if isinstance(data, Mapping) and isinstance(data.get("arguments"), Mapping):
            data = {**data, "arguments": json.dumps(thaw(data["arguments"]),
                                                    ensure_ascii=False)}
        return from_mapping(cls, data)


def _content_text(value: Any) -> Any:
    """Message content as text: a string, or a list of ``{"type": "text", "text"}`` parts
    (the OpenAI / Hugging Face shape), joined."""
    if not isinstance(value, (list, tuple)):
        return value
    pieces = []
    for part in value:
        kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
        _check(kind == "text" and isinstance(part.get("text"), str), "content", kind,
               "content parts must be {'type': 'text', 'text': ...} (only text is supported)")
        pieces.append(part["text"])
    return "".join(pieces)


def _tool_calls(value: Any) -> tuple[ToolCall, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise InvalidValueError("tool_calls", value, "must be a list of tool calls")
    return tuple(v if isinstance(v, ToolCall) else ToolCall.from_dict(v) for v in value)


@attrs.frozen
class Message:
    """One chat message, structured; never pre-rendered text."""

    role: str = attrs.field()
    content: str | None = attrs.field(default=None, converter=_content_text)
    tool_calls: tuple[ToolCall, ...] = attrs.field(default=(), converter=_tool_calls)
    tool_call_id: str | None = attrs.field(default=None, validator=_text)
    reasoning_content: str | None = attrs.field(default=None, validator=_text)
    name: str | None = attrs.field(default=None, validator=_text)

    @role.validator
    def _role(self, _: attrs.Attribute[str], value: str) -> None:
        _check(value in ROLES, "role", value, f"must be one of {', '.join(ROLES)}")

    @content.validator
    def _content(self, _: attrs.Attribute[Any], value: Any) -> None:
        _check(value is None or isinstance(value, str), "content", value, "must be a string")
        check_text("content", value)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Message:
        """Build from an OpenAI-style message mapping."""
        return from_mapping(cls, data)

    def to_template(self) -> dict[str, Any]:
        """The mapping a Hugging Face chat template expects for this message."""
        out: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if self.tool_calls:
            out["tool_calls"] = [
                {"type": "function", **({"id": c.id} if c.id is not None else {}),
                 "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls
            ]
        for key in ("tool_call_id", "reasoning_content", "name"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


@attrs.frozen
class ToolSpec:
    """A tool the model may call: name, description and a JSON-schema for its parameters."""

    name: str = attrs.field(validator=[attrs.validators.instance_of(str), _text])
    description: str = attrs.field(default="", validator=_text)
    parameters: Mapping[str, JSON] = attrs.field(
        factory=lambda: MappingProxyType({"type": "object", "properties": {}}),
        converter=_frozen_mapping, eq=False,
    )

    @name.validator
    def _name(self, _: attrs.Attribute[str], value: str) -> None:
        _check(bool(value), "name", value, "a tool needs a non-empty name")

    @parameters.validator
    def _parameters(self, _: attrs.Attribute[Any], value: Any) -> None:
        check_json_text("parameters", value)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ToolSpec:
        """Build from ``{"name", "description", "parameters"}`` or OpenAI's ``{"type":
        "function", "function": {...}}``."""
        if data.get("type") == "function" and "function" in data:
            data = data["function"]
        return from_mapping(cls, data)

    def to_template(self) -> dict[str, Any]:
        """The OpenAI-style tool mapping chat templates iterate over."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": thaw(self.parameters)}}


def thaw(value: Any) -> Any:
    """``value`` with every mapping a ``dict`` and every sequence a ``list`` (frozen values
    back to plain JSON-shaped data)."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(v) for v in value]
    return value


# --- generation parameters ----------------------------------------------------------------


def _logit_bias(value: Any) -> Mapping[int, float]:
    if not isinstance(value, Mapping):
        raise InvalidValueError("logit_bias", value, "must be a mapping of token id to bias")
    out: dict[int, float] = {}
    for key, bias in value.items():
        # JSON keys are strings: ASCII decimal ones name token ids ("²" and "٣" pass isdigit)
        decimal = isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12
        token = int(key) if decimal else key
        _check(_integer(token) and token >= 0, "logit_bias", key, "keys are token ids")
        _check(_number(bias) and -100 <= bias <= 100, f"logit_bias[{token}]", bias,
               "bias must be a number in [-100, 100]")
        out[token] = float(bias)
    return MappingProxyType(out)


def _optional_order(value: Any) -> tuple[str, ...] | None:
    return None if value is None else tuple(value)


@attrs.frozen
class GenerationConfig:
    """What to generate and how to choose tokens. Defaults follow the OpenAI API.

    ``temperature=0`` means greedy. ``top_k=0``, ``top_p=1``, ``min_p=0``, ``typical_p=1`` and
    penalties of 1 / 0 / 0 are "off", and so is ``dry_multiplier=0`` (the DRY sequence
    penalty: a token that would extend a run of ``L >= dry_allowed_length`` output tokens seen
    before loses ``dry_multiplier * dry_base ** (L - dry_allowed_length)``,
    :mod:`stages.process.dry`). ``processor_order`` overrides the builder's default chain
    order with the names of processors the pipeline has. ``reasoning_budget_tokens`` caps a
    ``<think>`` block: at the budget the engine forces the template's end-of-thinking marker.
    ``forced_prefix`` are token ids the output must begin with (e.g. a tool-call opening when
    a tool call is required); the engine takes them in place of the selector's choices.
    ``grammar`` (a :class:`~pipeline.grammar.Grammar`) constrains the output to a JSON schema
    or another grammar, by construction (the ``grammar`` processor, docs/design.md §11).

    Numeric edges follow rules, not float accidents: a temperature below ``GREEDY_BELOW``
    (1e-5) is greedy too; ``top_p`` and ``typical_p`` keep at least the most likely (most
    typical) token however small they are, so ``top_p=1e-320`` means "the most likely token";
    ``repetition_penalty`` lies in [0.01, 100] so penalized logits stay finite; every count is
    at most ``MAX_COUNT`` (2**30). A ``stop`` given as one string is one stop string.
    """

    max_tokens: int = attrs.field(default=DEFAULT_MAX_TOKENS,
                                  validator=_range(1, MAX_COUNT, integer=True))
    temperature: float = attrs.field(default=1.0, validator=_range(0, 100))
    top_k: int = attrs.field(default=0, validator=_range(0, MAX_COUNT, integer=True))
    top_p: float = attrs.field(default=1.0, validator=_range(0, 1, lo_open=True))
    min_p: float = attrs.field(default=0.0, validator=_range(0, 1))
    typical_p: float = attrs.field(default=1.0, validator=_range(0, 1, lo_open=True))
    repetition_penalty: float = attrs.field(default=1.0, validator=_range(0.01, 100))
    presence_penalty: float = attrs.field(default=0.0, validator=_range(-2, 2))
    frequency_penalty: float = attrs.field(default=0.0, validator=_range(-2, 2))
    dry_multiplier: float = attrs.field(default=0.0, validator=_range(0, 100))
    dry_base: float = attrs.field(default=1.75, validator=_range(1, 10))
    dry_allowed_length: int = attrs.field(default=2, validator=_range(1, 64, integer=True))
    logit_bias: Mapping[int, float] = attrs.field(
        factory=lambda: MappingProxyType({}), converter=_logit_bias, eq=False)
    stop: tuple[str, ...] = attrs.field(default=(), converter=_stop_strings)
    stop_token_ids: tuple[int, ...] = attrs.field(
        default=(), converter=_tuple_of_ints, validator=_token_ids)
    min_tokens: int = attrs.field(default=0, validator=_range(0, MAX_COUNT, integer=True))
    ignore_eos: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    seed: int | None = attrs.field(default=None)
    logprobs: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    top_logprobs: int = attrs.field(default=0, validator=_range(0, 20, integer=True))
    banned_token_ids: tuple[int, ...] = attrs.field(
        default=(), converter=_tuple_of_ints, validator=_token_ids)
    allowed_token_ids: tuple[int, ...] | None = attrs.field(
        default=None, converter=attrs.converters.optional(_tuple_of_ints),
        validator=attrs.validators.optional(_token_ids))
    processor_order: tuple[str, ...] | None = attrs.field(
        default=None, converter=_optional_order)
    reasoning_budget_tokens: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_range(0, MAX_COUNT, integer=True)))
    forced_prefix: tuple[int, ...] = attrs.field(
        default=(), converter=_tuple_of_ints, validator=_token_ids)
    grammar: Grammar | None = attrs.field(default=None, converter=grammar_value)

    @stop.validator
    def _stop(self, _: attrs.Attribute[Any], value: Any) -> None:
        _check(isinstance(value, tuple), "stop", value, "must be a string or a list of strings")
        _check(len(value) <= MAX_STOP, "stop", value, f"at most {MAX_STOP} stop strings")
        for s in value:
            _check(isinstance(s, str) and s != "", "stop", s, "stop strings are non-empty")
            check_text("stop", s)

    @seed.validator
    def _seed(self, _: attrs.Attribute[Any], value: Any) -> None:
        if value is not None:
            _check(_integer(value) and 0 <= value < 2**63, "seed", value,
                   "must be an integer in [0, 2**63)")

    @min_tokens.validator
    def _min_tokens(self, _: attrs.Attribute[Any], value: int) -> None:
        _check(value <= self.max_tokens, "min_tokens", value,
               f"cannot exceed max_tokens={self.max_tokens}")

    @top_logprobs.validator
    def _top_logprobs(self, _: attrs.Attribute[Any], value: int) -> None:
        _check(value == 0 or self.logprobs, "top_logprobs", value, "needs logprobs=True")

    @grammar.validator
    def _grammar(self, _: attrs.Attribute[Any], value: Any) -> None:
        _check(value is None or self.min_tokens == 0, "min_tokens", self.min_tokens,
               "cannot be combined with a grammar: the grammar decides where the output ends")

    @allowed_token_ids.validator
    def _allowed(self, _: attrs.Attribute[Any], value: Any) -> None:
        _check(value is None or len(value) > 0, "allowed_token_ids", value,
               "an empty allow-list would leave nothing to choose")

    @property
    def greedy(self) -> bool:
        """True when selection is argmax (``temperature < GREEDY_BELOW``, 0 included)."""
        return self.temperature < GREEDY_BELOW

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GenerationConfig:
        """Build from a mapping of field names; unknown keys are an error."""
        return from_mapping(cls, data)

    def token_ids_used(self) -> set[int]:
        """Every token id the config names; checked against the vocabulary once it is known."""
        ids = set(self.logit_bias) | set(self.stop_token_ids) | set(self.banned_token_ids)
        ids |= set(self.forced_prefix)
        return ids | set(self.allowed_token_ids or ())


@attrs.frozen
class RuntimeLimits:
    """Limits the engine enforces: wall-clock deadline, queue wait, and total context.
    Durations are in (0, ``MAX_SECONDS``]; a tiny one simply expires at the next check."""

    deadline_s: float | None = attrs.field(
        default=None, validator=attrs.validators.optional(_range(0, MAX_SECONDS, lo_open=True)))
    queue_timeout_s: float | None = attrs.field(
        default=None, validator=attrs.validators.optional(_range(0, MAX_SECONDS, lo_open=True)))
    max_context_tokens: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_range(1, MAX_COUNT, integer=True)))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RuntimeLimits:
        """Build from a mapping of field names; unknown keys are an error."""
        return from_mapping(cls, data)


class Recording(enum.Enum):
    """How much a trace records: digests of every data product (``digest``), also their
    content (``full``), or also, per step, each layer's hidden state at the position whose
    logits the step produced, as a digest and summary statistics (``taps``: a backend with
    :class:`~pipeline.contracts.model.LayerTaps`; :attr:`Request.tap_tensors` adds the
    tensors of one step's layers)."""

    DIGEST = "digest"
    FULL = "full"
    TAPS = "taps"

    @property
    def content(self) -> bool:
        """Whether the trace holds content (text, ids, top-k), not only digests."""
        return self is not Recording.DIGEST


MAX_TAP_RECORDS = 1 << 13
"""The most layer-tap records a request's trace holds (about 180 bytes of JSON each, so
about 1.5 MB: a 30-layer model's first 90 steps); the step that would pass it records
``{"step": t, "spent": MAX_TAP_RECORDS}`` instead, and the taps stop. A served trace
stays bounded whatever a client asks."""

MAX_TAP_VALUES = 1 << 18
"""The most hidden-state values a request's trace keeps as tensors (:class:`TapWindow`):
1 MiB as float32, a few MB of JSON."""


@attrs.frozen
class TapWindow:
    """The hidden states a ``taps`` trace keeps as tensors: step ``step``'s (the forward
    that produced the logits z_step: 1 is the prompt's), layers ``first .. last`` (each one's
    attention, MLP and residual taps; ``embed`` too when ``first`` is 0), at the position
    whose logits the step produced, up to :data:`MAX_TAP_VALUES` values in all.

    Written ``"3:0-5"`` (step 3, layers 0 to 5) or ``"3:7"`` (one layer), as
    ``pipeline run --tap-tensors`` takes it.
    """

    step: int = attrs.field()
    first: int = attrs.field()
    last: int = attrs.field()

    def __attrs_post_init__(self) -> None:
        for name in ("step", "first", "last"):
            value = getattr(self, name)
            _check(_integer(value) and 0 <= value <= MAX_COUNT, "tap_tensors", value,
                   f"{name} must be a whole number 0..{MAX_COUNT}")
        _check(self.step >= 1, "tap_tensors", self.step, "steps count from 1")
        _check(self.first <= self.last, "tap_tensors", f"{self.first}-{self.last}",
               "the first layer comes before the last")

    @classmethod
    def parse(cls, value: Any) -> TapWindow:
        """A window from ``"STEP:FIRST-LAST"``, ``"STEP:LAYER"``, a mapping of its fields, or
        a window."""
        if isinstance(value, TapWindow):
            return value
        if isinstance(value, Mapping):
            return from_mapping(cls, value)
        if isinstance(value, str):
            step, colon, layers = value.strip().partition(":")
            first, _, last = layers.partition("-")
            parts = (step, first, last or first)
            if colon and all(p.strip().isdigit() for p in parts):
                return cls(*(int(p) for p in parts))
        raise InvalidValueError("tap_tensors", value, "must be STEP:FIRST-LAST (e.g. 3:0-5) "
                                "or STEP:LAYER")

    def holds(self, name: str) -> bool:
        """Whether the tap ``name`` (``embed``, ``layers.i...``) is in the window."""
        parts = name.split(".")
        if parts[0] != "layers":
            return self.first == 0
        return self.first <= int(parts[1]) <= self.last


def _tap_window(value: Any) -> TapWindow | None:
    return None if value is None else TapWindow.parse(value)


def _new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:16]}"


def _messages(value: Any) -> tuple[Message, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise InvalidValueError("messages", value, "must be a list of messages")
    return tuple(m if isinstance(m, Message) else Message.from_dict(m) for m in value)


def _tools(value: Any) -> tuple[ToolSpec, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise InvalidValueError("tool_catalog", value, "must be a list of tools")
    tools = tuple(t if isinstance(t, ToolSpec) else ToolSpec.from_dict(t) for t in value)
    for tool in tools:
        check_tool_parameters(tool)
    return tools


def object_schema(schema: Any) -> bool:
    """Whether ``schema`` admits only JSON objects (type ``object``, or no type at all: the
    arguments object is what a call writes)."""
    if schema is True or schema == {}:
        return True
    if not isinstance(schema, Mapping):
        return False
    kind = schema.get("type", "object")
    return bool(kind == "object" or kind == ["object"])


def check_tool_parameters(tool: ToolSpec) -> None:
    """A tool's ``parameters`` are a valid JSON schema (Draft 2020-12) of an object, or
    :class:`InvalidValueError` naming the tool: checked for every request that carries the
    tool, whatever its tool choice, so a schema the model could never be held to is refused
    at the door rather than only when a call is forced."""
    text = json.dumps(thaw(tool.parameters), sort_keys=True)
    problem = _schema_problem(text)
    if problem is not None:
        raise InvalidValueError(f"tools[{tool.name}].parameters", "(schema)", problem)


@functools.lru_cache(maxsize=256)
def _schema_problem(text: str) -> str | None:
    """Why the schema ``text`` cannot be a tool's parameters (None: it can). Cached: a
    server sees the same few tool schemas on request after request."""
    import jsonschema  # here, not at import: only requests with tools need it

    schema = json.loads(text)
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(part) for part in exc.absolute_path)
        return f"not a valid JSON schema: {exc.message}" + (f" (at /{where})" if where else "")
    if not object_schema(schema):
        return ("must be an object schema (\"type\": \"object\"): a call's arguments are "
                "a JSON object")
    return None


TOOL_CHOICES = ("auto", "none", "required", "tool")


@attrs.frozen
class ToolChoice:
    """Whether and how the model calls the request's tools.

    ``kind``: ``auto`` (it may call, or answer), ``none`` (it answers; the tools are not
    shown), ``required`` (it calls at least one tool), ``tool`` (it calls the tool ``name``,
    the only one shown). ``parallel`` False allows at most one call. ``strict`` makes even
    optional calls valid by construction (a grammar over the calls; a required call always
    is). Build it from what the dialects send with :meth:`coerce`: ``"auto"``, ``"none"``,
    ``"required"`` (or ``"any"``), a tool's name, ``{"name": ...}``, OpenAI's
    ``{"type": "function", "function": {"name": ...}}`` or Anthropic's ``{"type": "tool",
    "name": ...}``.
    """

    kind: str = "auto"
    name: str = ""
    parallel: bool = True
    strict: bool = False

    def __attrs_post_init__(self) -> None:
        _check(self.kind in TOOL_CHOICES, "tool_choice", self.kind,
               f"must be one of {', '.join(TOOL_CHOICES)}")
        _check(isinstance(self.name, str) and (self.kind == "tool") == bool(self.name),
               "tool_choice", self.name, "a named choice names one tool; no other has a name")
        check_text("tool_choice", self.name)
        for field in ("parallel", "strict"):
            _check(isinstance(getattr(self, field), bool), f"tool_choice.{field}",
                   getattr(self, field), "must be true or false")

    @property
    def forced(self) -> bool:
        """Whether the output must be a call."""
        return self.kind in ("required", "tool")

    @classmethod
    def coerce(cls, value: Any) -> ToolChoice:
        """A :class:`ToolChoice` from any of the forms in the class docstring (a mapping with
        ``kind`` is the recorded form, read back)."""
        if isinstance(value, ToolChoice):
            return value
        if value is None:
            return cls()
        if isinstance(value, str):
            word = "required" if value == "any" else value
            return cls(word) if word in ("auto", "none", "required") else cls("tool", value)
        if not isinstance(value, Mapping):
            raise InvalidValueError("tool_choice", value, "must be a string or a mapping")
        if "kind" in value:
            return from_mapping(cls, value)
        kind = value.get("type")
        function = value.get("function")
        if kind == "function" and isinstance(function, Mapping) and "name" in function:
            return cls("tool", str(function["name"]))
        if kind in ("tool", None) and "name" in value:
            return cls("tool", str(value["name"]))
        if isinstance(kind, str) and kind in ("auto", "none", "required", "any"):
            return cls.coerce(kind)
        raise InvalidValueError("tool_choice", value, "must be 'auto', 'none', 'required' or "
                                "name a tool ({\"name\": ...})")

    def shown(self, tools: tuple[ToolSpec, ...]) -> tuple[ToolSpec, ...]:
        """The tools the prompt shows under this choice (none for ``none``, the named one
        for ``tool``)."""
        if self.kind == "none":
            return ()
        if self.kind == "tool":
            return tuple(t for t in tools if t.name == self.name)
        return tools


def _tool_choice(value: Any) -> ToolChoice:
    return ToolChoice.coerce(value)


def _config(value: Any) -> GenerationConfig:
    return value if isinstance(value, GenerationConfig) else GenerationConfig.from_dict(value)


def _limits(value: Any) -> RuntimeLimits:
    return value if isinstance(value, RuntimeLimits) else RuntimeLimits.from_dict(value)


@attrs.frozen
class Request:
    """A normalized request: structured messages (or a raw ``prompt``, or raw ``prompt_ids``)
    plus everything that decides its output. The pipeline fills ``model_snapshot``,
    ``template_version`` and ``tokenizer_version`` with content digests when it accepts the
    request.

    Exactly one of the three prompt forms is given. ``messages`` go through the chat template;
    ``prompt`` is text taken as it is, all content (no template, special-token strings not
    parsed, nothing added); ``prompt_ids`` are the model's input ids themselves (not
    re-tokenized; each below the model's vocabulary size)."""

    messages: tuple[Message, ...] = attrs.field(default=(), converter=_messages)
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = attrs.field(
        default=None, converter=attrs.converters.optional(_tuple_of_ints))
    request_id: str = attrs.field(factory=_new_request_id)
    generation_config: GenerationConfig = attrs.field(
        factory=GenerationConfig, converter=_config)
    runtime_limits: RuntimeLimits = attrs.field(factory=RuntimeLimits, converter=_limits)
    tool_catalog: tuple[ToolSpec, ...] = attrs.field(default=(), converter=_tools)
    tool_choice: ToolChoice = attrs.field(factory=ToolChoice, converter=_tool_choice)
    template_kwargs: Mapping[str, JSON] = attrs.field(
        factory=lambda: MappingProxyType({}), converter=_frozen_mapping, eq=False)
    client_metadata: Mapping[str, str] = attrs.field(
        factory=lambda: MappingProxyType({}), converter=_frozen_mapping, eq=False)
    model_snapshot: str | None = None
    template_version: str | None = None
    tokenizer_version: str | None = None
    recording: Recording = attrs.field(default=Recording.DIGEST, converter=Recording)
    tap_tensors: TapWindow | None = attrs.field(default=None, converter=_tap_window)
    schema_version: int = SCHEMA_VERSION

    def __attrs_post_init__(self) -> None:
        given = [bool(self.messages), self.prompt is not None, self.prompt_ids is not None]
        _check(given.count(True) == 1, "messages", self.messages,
               "give exactly one of messages (chat), prompt (raw text) or prompt_ids (token ids)")
        _check(self.prompt_ids is None or isinstance(self.prompt_ids, tuple), "prompt_ids",
               self.prompt_ids, "must be a list of token ids")
        _check(self.prompt_ids != (), "prompt_ids", self.prompt_ids, "the prompt is empty")
        for token in self.prompt_ids or ():
            _check(_integer(token) and token >= 0, "prompt_ids", token,
                   "token ids are non-negative integers")
        _check(self.prompt is None or isinstance(self.prompt, str), "prompt", self.prompt,
               "must be a string")
        check_text("prompt", self.prompt)
        check_json_text("template_kwargs", self.template_kwargs)
        check_json_text("client_metadata", self.client_metadata)
        _check(isinstance(self.request_id, str) and bool(self.request_id), "request_id",
               self.request_id, "must be a non-empty string")
        check_text("request_id", self.request_id)
        if self.tool_choice.kind == "tool":
            _check(any(t.name == self.tool_choice.name for t in self.tool_catalog),
                   "tool_choice", self.tool_choice.name, "names no tool in the request's tools")
        _check(not self.tool_choice.forced or bool(self.tool_catalog), "tool_choice",
               self.tool_choice.kind, "requires tools")
        _check(self.tap_tensors is None or self.recording is Recording.TAPS, "tap_tensors",
               str(self.tap_tensors), "keeps tensors in a trace recorded with layer taps "
               "(recording='taps')")

    @property
    def tools_shown(self) -> tuple[ToolSpec, ...]:
        """The tools the prompt shows and the output may call (:meth:`ToolChoice.shown`)."""
        return self.tool_choice.shown(self.tool_catalog)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Request:
        """Build from a mapping; nested messages, tools and configs may be mappings too."""
        return from_mapping(cls, data)

    @classmethod
    def coerce(cls, prompt: str | Sequence[Message | Mapping[str, Any]] | Request,
               **fields: Any) -> Request:
        """A ``Request`` from what ``Pipeline.generate`` accepts: a string is one user
        message, a list is the conversation, a ``Request`` passes through (``fields`` then
        replace its own via ``attrs.evolve``)."""
        if isinstance(prompt, Request):
            return attrs.evolve(prompt, **fields) if fields else prompt
        if isinstance(prompt, str):
            return cls(messages=(Message("user", prompt),), **fields)
        return cls(messages=prompt, **fields)


