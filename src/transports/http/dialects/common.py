"""What the dialects share: the parsed request, server defaults, message content as text,
the traceparent check.

Owns :class:`Parsed` (a dialect's request body as the internal :class:`~pipeline.contracts.request.Request`
plus how to answer it), :class:`RawPrompts` (a completions request's prompts),
:class:`ServerDefaults` (the server-side defaults a body may leave out),
:class:`StreamEncoder` (a dialect's streamed answer), :func:`config_from`,
:func:`with_model_defaults` (the served model's sampling in the fields a body left out),
:func:`text_content` and :func:`traceparent`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs

from pipeline.errors import InvalidValueError, LimitExceededError
from pipeline.sampling_defaults import DEFAULTED_FIELDS
from pipeline.contracts.output import Completion, Delta
from pipeline.contracts.request import GenerationConfig, Request
from pipeline.contracts.output import Part
from pipeline.contracts.request import DEFAULT_MAX_TOKENS
from transports.http.dialects.fields import Obj, check
from transports.http.dialects.documents import Document

TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


@attrs.frozen
class ServerDefaults:
    """Server-side defaults for fields a request leaves out."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    reasoning_budget_tokens: int | None = None


RawPrompt = str | tuple[int, ...]
"""A completions prompt: text (tokenized as a document of its own), or token ids."""


def _ids(path: str, value: list[Any], noun: str) -> tuple[int, ...]:
    if not value:
        raise InvalidValueError(path, [], f"a token-id {noun} needs at least one id")
    for i, token in enumerate(value):
        check(f"{path}[{i}]", token, "integer")
        if token < 0:
            raise InvalidValueError(f"{path}[{i}]", token, "token ids are non-negative")
    return tuple(value)


def raw_prompts(body: Obj, field: str, most: int | None = None) -> tuple[RawPrompt, ...]:
    """A prompt field of ``/v1/completions`` (``prompt``) or ``/v1/embeddings`` (``input``,
    at most ``most`` items): a string, a list of ids, or a non-empty list of either."""
    value = body.value.get(field)
    body.has(field)
    if value is None:
        raise InvalidValueError(field, None, "is required")
    if isinstance(value, str):
        return (value,)
    check(field, value, "array")
    if not value:
        raise InvalidValueError(field, [], f"at least one {field} is required")
    if most is not None and len(value) > most:
        raise LimitExceededError(field, f"max_{field}s", len(value), most, f"{field}s")
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return (_ids(field, value, field),)
    out: list[RawPrompt] = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, list):
            out.append(_ids(f"{field}[{i}]", item, field))
        else:
            raise InvalidValueError(f"{field}[{i}]", item,
                                    "must be a string or a list of token ids")
    return tuple(out)


@attrs.frozen
class RawPrompts:
    """The prompts of a ``/v1/completions`` request (one generation each, times ``n``), and
    the parts of its answer chat has not: ``echo`` (the prompt before each choice's text) and
    ``logprobs`` (the legacy count of alternatives per token; None: no logprobs)."""

    prompts: tuple[RawPrompt, ...]
    echo: bool = False
    logprobs: int | None = None


@attrs.frozen
class Parsed:
    """A request body, understood: the served model's name, the internal request, and the
    answer's form. ``max_tokens_given`` tells the window arithmetic whether it may clamp
    silently; ``tools`` turns on tool-call parsing of the output."""

    model: str
    request: Request
    stream: bool
    max_tokens_given: bool
    tools: bool
    include_usage: bool = False
    thinking: bool = False
    """The prompt left a ``<think>`` block open: the output starts as reasoning."""
    n: int = 1
    """Choices per prompt (:mod:`transports.http.server.choices` has the seed rule)."""
    raw: RawPrompts | None = None
    """The raw prompts of a completions request (``request`` is then the first prompt's;
    each prompt's own request replaces its prompt with the prompt's ids)."""
    sampling_given: frozenset[str] | None = None
    """The sampling fields (:data:`~pipeline.sampling_defaults.DEFAULTED_FIELDS`) the body
    set; the others take the served pipeline's defaults (:func:`with_model_defaults`).
    None: the request's config is complete as parsed."""
    budget_field: str = "max_tokens"
    """The body's name for the output budget (``max_completion_tokens``, Responses'
    ``max_output_tokens``), so a refusal of it names what the client sent."""
    documents: tuple[Document, ...] = ()
    """The document parts the messages hold as text (:mod:`transports.http.dialects.documents`), which
    the window fit may cut."""


class StreamEncoder(Protocol):
    """A dialect's streamed answer as SSE bytes: ``start`` once, ``delta`` for each engine
    delta of choice ``index`` (with the parts the output splitter made of it; a choice's
    final delta may close that choice), ``end`` once with every choice's completion."""

    def start(self) -> bytes:
        """The opening events."""
        ...

    def delta(self, index: int, parts: Sequence[Part], delta: Delta) -> bytes:
        """Events for one delta of choice ``index`` (may be empty)."""
        ...

    def end(self, completions: Sequence[Completion]) -> bytes:
        """The closing events."""
        ...


def config_from(fields: dict[str, Any], max_tokens: int | None,
                defaults: ServerDefaults) -> GenerationConfig:
    """A :class:`GenerationConfig` from dialect-neutral ``fields`` plus the server defaults."""
    fields = dict(fields)
    fields["max_tokens"] = max_tokens if max_tokens is not None else defaults.max_tokens
    if "reasoning_budget_tokens" not in fields and defaults.reasoning_budget_tokens is not None:
        fields["reasoning_budget_tokens"] = defaults.reasoning_budget_tokens
    return GenerationConfig.from_dict(fields)


def sampling_given(raw: Any) -> frozenset[str]:
    """The sampling fields a request body sets (a ``null`` sets nothing)."""
    if not isinstance(raw, dict):
        return frozenset()
    return frozenset(f for f in DEFAULTED_FIELDS if raw.get(f) is not None)


def with_model_defaults(parsed: Parsed, defaults: GenerationConfig) -> Parsed:
    """``parsed`` with the served pipeline's defaults (``Pipeline.defaults``: the model's
    recommended sampling, else the pipeline default) in every sampling field the body left
    out. The dialects' own documented defaults (temperature 1 in OpenAI's and Anthropic's
    APIs) are deliberately not used: a request that sets nothing samples as the library and
    the command line do (docs/serving.md)."""
    if parsed.sampling_given is None:
        return parsed
    fill = {f: getattr(defaults, f) for f in DEFAULTED_FIELDS if f not in parsed.sampling_given}
    config = attrs.evolve(parsed.request.generation_config, **fill)
    return attrs.evolve(parsed, request=attrs.evolve(parsed.request, generation_config=config))


def text_content(path: str, value: Any, text_type: str,
                 cache_control: Callable[[Obj], None] | None = None,
                 files: Callable[[Obj], Document] | None = None,
                 documents: list[Document] | None = None) -> str | None:
    """Message content as text: a string, or a list of ``{"type": text_type, "text"}`` parts.
    A part's ``cache_control`` is checked by ``cache_control`` (a dialect's rule for the
    hint), else only as an object. With ``files``, a ``file`` part is a document read by it:
    its text joins the content (on lines of its own) and the document ``documents``."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise InvalidValueError(path, type(value).__name__, "must be a string or a list of parts")
    pieces = []
    for i, raw in enumerate(value):
        part = Obj(raw, f"{path}[{i}]")
        kind = part.need("type", "string")
        if kind == "file" and files is not None and documents is not None:
            document = files(part)
            documents.append(document)
            pieces.append(f"\n{document.block}\n")
            part.done()
            continue
        if kind != text_type:
            allowed = f"'{text_type}' and 'file'" if files is not None else f"'{text_type}'"
            raise InvalidValueError(f"{path}[{i}].type", kind,
                                    f"is not supported here: only {allowed} parts")
        pieces.append(part.need("text", "string"))
        if cache_control is None:
            part.get("cache_control", "object")
        else:
            cache_control(part)
        part.done()
    return "".join(pieces)


def traceparent(value: str | None) -> dict[str, str]:
    """``{"traceparent": value}`` for a valid W3C trace-context header, ``{}`` when absent."""
    if value is None:
        return {}
    match = TRACEPARENT.match(value.strip())
    if (match is None or match.group(1) == "ff" or set(match.group(2)) == {"0"}
            or set(match.group(3)) == {"0"}):
        raise InvalidValueError("traceparent", value,
                                "must be W3C trace-context: 2-32-16-2 lowercase hex digits, "
                                "non-zero trace and parent ids, version not ff")
    return {"traceparent": value.strip()}
