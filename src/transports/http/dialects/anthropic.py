"""The Anthropic dialect: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

Owns :func:`parse_messages` (a Messages body → :class:`~transports.http.dialects.common.Parsed`:
system prompt, ``text`` / ``tool_use`` / ``tool_result`` / ``thinking`` blocks (each block's
``cache_control`` checked as the top level's and a tool's are: ``{"type": "ephemeral",
"ttl"?}``, a 400 naming its path otherwise), tools,
``tool_choice``, ``thinking.budget_tokens`` as the reasoning budget), :func:`message_body` (the
non-stream answer) and :class:`MessageStream` (``message_start``, ``content_block_start`` /
``delta`` / ``stop`` for ``thinking``, ``text`` and ``tool_use`` with ``input_json_delta``,
``message_delta`` with ``stop_reason`` and usage, ``message_stop``, and ``ping``), and
:func:`usage_body`, Anthropic's split of a prompt into tokens read from the prefix cache and
the rest.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

import attrs

from pipeline.errors import InvalidValueError
from pipeline.contracts.output import (
    Completion, Delta, FinishReason, ToolCallDelta, ToolCallEnd, Usage,
)
from pipeline.contracts.request import (
    GenerationConfig, Message, Request, ToolCall, ToolChoice, ToolSpec,
)
from transports.http.dialects.common import (
    Parsed, ServerDefaults, config_from, sampling_given, text_content,
)
from transports.http.dialects.documented import anthropic_fields, anthropic_tool, cache_control
from transports.http.dialects.documents import Document, decode_base64, media_type, read_document
from transports.http.dialects.fields import Obj, check
from transports.http.dialects.spec import ANTHROPIC_SAMPLING, one_of, read, unsupported
from pipeline.contracts.output import Part, TextPart
from transports.sse import SSEEvent, encode


def _tool_result(path: str, block: Obj) -> Message:
    content = text_content(f"{path}.content", block.value.get("content"), "text",
                           cache_control) or ""
    block.has("content")
    if block.get("is_error", "boolean", False):
        content = f"Error: {content}"
    return Message("tool", content, tool_call_id=block.need("tool_use_id", "string"))


def _document(block: Obj) -> Document:
    """A ``document`` block: a ``base64`` source (PDF, DOCX, XLSX, CSV, text) or a ``text``
    one, named by its ``title``; ``context`` goes before its text."""
    source = block.obj("source")
    if source is None:
        raise InvalidValueError(block.at("source"), None, "is required")
    kind = source.need("type", "string")
    name = block.get("title", "string") or "document"
    context = block.get("context", "string")
    citations = block.obj("citations")
    if citations is not None:
        citations.get("enabled", "boolean")
        citations.done()
    if kind == "base64":
        media = media_type(name, source.need("media_type", "string"), source.at("media_type"))
        data = decode_base64(source.need("data", "string"), source.at("data"))
        text = read_document(name, media, data, source.at("data"))
    elif kind == "text":
        media_type(name, source.get("media_type", "string") or "text/plain",
                   source.at("media_type"))
        text = source.need("data", "string")
    else:
        raise unsupported(source.at("type"), kind, "base64 and text document sources only "
                          "(nothing is fetched from a URL or a file store)")
    source.done()
    return Document.of(name, f"{context}\n\n{text}" if context else text)


def _blocks(path: str, role: str, value: Any, documents: list[Document]) -> list[Message]:
    """One Anthropic message → internal messages (tool results become ``tool`` messages;
    a user's ``document`` blocks become text, each also noted in ``documents``)."""
    if isinstance(value, str):
        return [Message(role, value)]
    texts, thinking, calls, results = [], [], [], []
    for i, raw in enumerate(check(path, value, "array")):
        at = f"{path}[{i}]"
        block = Obj(raw, at)
        kind = block.need("type", "string")
        cache_control(block)
        if kind == "text":
            texts.append(block.need("text", "string"))
            block.get("citations", "array")
        elif kind == "thinking" and role == "assistant":
            thinking.append(block.need("thinking", "string"))
            block.get("signature", "string")
        elif kind == "tool_use" and role == "assistant":
            block.get("caller", "object")  # who issued the call; the SDK echoes it back
            # as the library encodes a mapping of arguments (and a template's ``tojson``)
            calls.append(ToolCall(block.need("name", "string"),
                                  json.dumps(block.need("input", "object"), ensure_ascii=False),
                                  block.need("id", "string")))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(at, block))
        elif kind == "document" and role == "user":
            document = _document(block)
            documents.append(document)
            texts.append(f"\n{document.block}\n")
        else:
            allowed = ("text, thinking and tool_use" if role == "assistant"
                       else "text, document and tool_result")
            raise unsupported(f"{at}.type", kind, f"a {role} message takes {allowed} blocks")
        block.done()
    text = "".join(texts)
    if role == "assistant":
        return [Message("assistant", text, calls, reasoning_content="".join(thinking) or None)]
    return results + ([Message("user", text)] if texts or not results else [])


def _messages(body: Obj, documents: list[Document]) -> list[Message]:
    out: list[Message] = []
    system = body.value.get("system")
    body.has("system")
    if system is not None:
        out.append(Message("system", text_content("system", system, "text", cache_control)))
    for path, raw in body.items("messages", required=True):
        o = Obj(raw, path)
        role = o.need("role", "string")
        if role not in ("user", "assistant"):
            raise InvalidValueError(f"{path}.role", role, "must be 'user' or 'assistant'")
        o.has("content")
        if "content" not in o.value:
            raise InvalidValueError(f"{path}.content", None, "is required")
        out.extend(_blocks(f"{path}.content", role, o.value["content"], documents))
        o.done()
    if not any(m.role != "system" for m in out):
        raise InvalidValueError("messages", [], "at least one message is required")
    return out


def _tools(body: Obj) -> tuple[list[ToolSpec], ToolChoice]:
    """The tools offered, and the choice among them (``tool_choice``, its
    ``disable_parallel_tool_use``, any tool's ``strict``)."""
    tools = []
    strict = False
    for path, raw in body.items("tools"):
        o = Obj(raw, path)
        strict = strict or o.value.get("strict") is True
        anthropic_tool(o)
        tools.append(ToolSpec(o.need("name", "string"), o.get("description", "string", ""),
                              o.need("input_schema", "object")))
        o.done()
    choice = body.obj("tool_choice")
    if choice is None:
        return tools, ToolChoice(strict=strict)
    kind = choice.need("type", "string")
    parallel = not choice.get("disable_parallel_tool_use", "boolean", False)
    name = choice.get("name", "string")
    choice.done()
    if kind == "tool":
        if not any(t.name == name for t in tools):
            raise InvalidValueError("tool_choice.name", name, "names no tool in 'tools'")
        return tools, ToolChoice("tool", name, parallel=parallel, strict=strict)
    if kind not in ("auto", "any", "none"):
        raise InvalidValueError("tool_choice.type", kind, "must be auto, any, tool or none")
    if kind == "any" and not tools:
        raise InvalidValueError("tool_choice.type", kind, "requires 'tools'")
    return tools, ToolChoice("required" if kind == "any" else kind, parallel=parallel,
                             strict=strict)


def _config(body: Obj, defaults: ServerDefaults, *, counting: bool
            ) -> tuple[GenerationConfig, bool | None]:
    """The generation config, and ``thinking.type`` as a template's ``enable_thinking``."""
    fields = read(body, ANTHROPIC_SAMPLING)
    seed = body.get("seed", "integer")  # an extension: the Messages API has no seed
    if seed is not None:
        fields["seed"] = seed % (1 << 63)
    stops = [check(p, s, "string") for p, s in body.items("stop_sequences")]
    if stops:
        fields["stop"] = stops
    enable, budget = _thinking(body)
    if budget is not None:
        fields["reasoning_budget_tokens"] = budget
    max_tokens = None if counting else body.num("max_tokens", 1, 1 << 30, integer=True)
    if not counting and max_tokens is None:
        raise InvalidValueError("max_tokens", None, "is required")
    return config_from(fields, max_tokens, defaults), enable


_THINKING = ("enabled", "disabled", "adaptive", "between_tools")


def _thinking(body: Obj) -> tuple[bool | None, int | None]:
    """``thinking`` as the template's ``enable_thinking`` (None: not given) and the reasoning
    budget (``budget_tokens`` of ``enabled``). ``adaptive`` and ``between_tools`` think
    without a budget; ``display`` is accepted and ignored (thinking is always shown)."""
    thinking = body.obj("thinking")
    if thinking is None:
        return None, None
    kind = one_of(thinking, "type", _THINKING)
    if kind is None:
        raise InvalidValueError("thinking.type", None, "is required")
    budget = None
    if kind == "enabled":
        budget = thinking.num("budget_tokens", 0, 1 << 30, integer=True)
        if budget is None:
            raise InvalidValueError("thinking.budget_tokens", None, "is required")
    if kind != "disabled":
        one_of(thinking, "display", ("summarized", "omitted"))
    thinking.done()
    return kind != "disabled", budget


def parse_messages(raw: Any, defaults: ServerDefaults, *, counting: bool = False) -> Parsed:
    """A Messages (or count_tokens) body → the internal request and how to answer it."""
    body = Obj(raw, "body")
    model = body.need("model", "string")
    documents: list[Document] = []
    messages = _messages(body, documents)
    tools, choice = _tools(body)
    config, enable_thinking = _config(body, defaults, counting=counting)
    stream = False if counting else body.get("stream", "boolean", False)
    metadata = None if counting else body.obj("metadata")
    user = None
    if metadata is not None:
        user = metadata.get("user_id", "string")
        metadata.done()
    grammar = anthropic_fields(body)
    body.done()
    config = attrs.evolve(config, grammar=grammar)
    request = Request(messages=messages, generation_config=config, tool_catalog=tools,
                      tool_choice=choice,
                      request_id=f"msg_{uuid.uuid4().hex[:24]}",
                      client_metadata={"user": user} if user else {},
                      template_kwargs=({} if enable_thinking is None
                                       else {"enable_thinking": enable_thinking}))
    return Parsed(model, request, stream, True, bool(request.tools_shown),
                  sampling_given=sampling_given(raw), documents=tuple(documents))


# --- responses -----------------------------------------------------------------------------


def stop_reason(completion: Completion, tool_calls: bool) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence``."""
    reason = completion.finish_reason
    if reason is FinishReason.STOP_STRING:
        return "stop_sequence", str(completion.stop_reason)
    if reason in (FinishReason.LENGTH, FinishReason.DEADLINE):
        return "max_tokens", None
    if tool_calls:
        return "tool_use", None
    return ("end_turn" if reason is not FinishReason.ERROR else "refusal"), None


def _block(part: TextPart | ToolCall) -> dict[str, Any]:
    if isinstance(part, ToolCall):
        return {"type": "tool_use", "id": _tool_id(part.id), "name": part.name,
                "input": json.loads(part.arguments)}
    if part.kind == "thinking":
        return {"type": "thinking", "thinking": part.text, "signature": ""}
    return {"type": "text", "text": part.text}


def _tool_id(call_id: str | None) -> str:
    return "toolu_" + (call_id or "").removeprefix("call_")


def _merged(parts: Sequence[Part]) -> list[TextPart | ToolCall]:
    """Text runs joined; each well-formed call once (its deltas are for streams)."""
    out: list[TextPart | ToolCall] = []
    for part in parts:
        if isinstance(part, ToolCallDelta):
            continue
        if isinstance(part, ToolCallEnd):
            if part.call is not None:
                out.append(part.call)
            continue
        last = out[-1] if out else None
        if (isinstance(part, TextPart) and isinstance(last, TextPart)
                and last.kind == part.kind):
            out[-1] = TextPart(part.kind, last.text + part.text)
        else:
            out.append(part)
    return out


def usage_body(usage: Usage) -> dict[str, int]:
    """A finished message's ``usage`` as Anthropic counts it: ``input_tokens`` are the prompt
    tokens *not* read from the cache, so that ``input_tokens + cache_creation_input_tokens +
    cache_read_input_tokens`` is the whole prompt. The prefix cache is automatic
    (docs/design.md §6): nothing is written to it at a client's request, so
    ``cache_creation_input_tokens`` is 0."""
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": usage.cached_tokens,
            "output_tokens": usage.completion_tokens}


def message_body(parsed: Parsed, completion: Completion, parts: Sequence[Part]) -> dict[str, Any]:
    """The non-stream response body."""
    blocks = [_block(p) for p in _merged(parts)]
    reason, sequence = stop_reason(completion, any(b["type"] == "tool_use" for b in blocks))
    return {"id": parsed.request.request_id, "type": "message", "role": "assistant",
            "model": parsed.model, "content": blocks, "stop_reason": reason,
            "stop_sequence": sequence, "usage": usage_body(completion.usage)}


def _event(kind: str, body: dict[str, Any]) -> bytes:
    return encode(SSEEvent(json.dumps({"type": kind, **body}, ensure_ascii=False), kind))


PING = _event("ping", {})


class MessageStream:
    """The event sequence of one streamed message, as SSE bytes."""

    def __init__(self, parsed: Parsed, request_id: str, prompt_tokens: int) -> None:
        self.parsed = parsed
        self._id = request_id
        self._prompt_tokens = prompt_tokens
        self._index = -1
        self._open: str | None = None  # kind of the open content block
        self._tool_calls = False

    def start(self) -> bytes:
        """``message_start`` and a first ``ping``. The stream opens before the engine admits
        the request and looks its prompt up in the prefix cache, so ``input_tokens`` here is
        the whole prompt and the cache fields are absent; ``message_delta`` then carries the
        final counts (:func:`usage_body`), which replace these as the SDKs accumulate them."""
        return _event("message_start", {"message": {
            "id": self._id, "type": "message", "role": "assistant", "content": [],
            "model": self.parsed.model, "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self._prompt_tokens, "output_tokens": 0}}}) + PING

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        self._open = None
        return _event("content_block_stop", {"index": self._index})

    def _begin(self, kind: str, block: dict[str, Any]) -> bytes:
        out = self._close()
        self._index += 1
        self._open = kind
        return out + _event("content_block_start", {"index": self._index, "content_block": block})

    def delta(self, index: int, parts: Sequence[Part], delta: Delta) -> bytes:
        """Block events for the parts one engine delta produced (a message has one choice:
        ``index`` is 0)."""
        out: list[bytes] = []
        for part in parts:
            if isinstance(part, (ToolCallDelta, ToolCallEnd)):
                out.append(self._tool_part(part))
                continue
            if self._open != part.kind:
                empty = ({"type": "thinking", "thinking": "", "signature": ""}
                         if part.kind == "thinking" else {"type": "text", "text": ""})
                out.append(self._begin(part.kind, empty))
            body = ({"type": "thinking_delta", "thinking": part.text} if part.kind == "thinking"
                    else {"type": "text_delta", "text": part.text})
            out.append(_event("content_block_delta", {"index": self._index, "delta": body}))
        return b"".join(out)

    def _tool_part(self, part: ToolCallDelta | ToolCallEnd) -> bytes:
        """A ``tool_use`` block opens with the call's name, its input streams as
        ``input_json_delta`` fragments as they are generated, and it closes at the call's end."""
        if isinstance(part, ToolCallEnd):
            self._tool_calls = self._tool_calls or part.call is not None
            return self._close()
        if part.name is not None:
            return self._begin("tool_use", {"type": "tool_use", "id": _tool_id(part.id),
                                            "name": part.name, "input": {}})
        return _event("content_block_delta", {"index": self._index, "delta": {
            "type": "input_json_delta", "partial_json": part.arguments}})

    def end(self, completions: Sequence[Completion]) -> bytes:
        """Close the open block, then ``message_delta`` (the stop reason and the whole
        usage, cumulative as Anthropic's are) and ``message_stop``."""
        (completion,) = completions
        reason, sequence = stop_reason(completion, self._tool_calls)
        return self._close() + _event("message_delta", {
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage_body(completion.usage)}) + _event(
            "message_stop", {})
