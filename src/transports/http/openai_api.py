"""The OpenAI dialect: ``POST /v1/chat/completions`` bodies in, completions and chunks out.

Owns :func:`parse_chat` (a request body → :class:`~transports.http.common.Parsed`, every field
type- and range-checked, unknown fields refused), :func:`chat_completion` (the non-stream
body) and :class:`ChatStream` (the ``chat.completion.chunk`` sequence, ``data: [DONE]`` last).
Tool calls found in the output become ``tool_calls`` (streamed as deltas: id and name first,
then the arguments) and ``finish_reason: "tool_calls"``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from pipeline.errors import InvalidValueError
from pipeline.protocols import Tokenizer
from pipeline.types import (
    Completion, Delta, FinishReason, GenerationConfig, Message, Request, TokenLogprob, ToolCall,
    ToolSpec, token_text,
)
from transports.http.common import Parsed, ServerDefaults, config_from, text_content
from transports.http.fields import Obj, check
from transports.http.output import Part, TextPart, ToolCallPart
from transports.sse import SSEEvent, encode

_ROLES = ("system", "developer", "user", "assistant", "tool")
# OpenAI field → GenerationConfig field, with (lo, hi, integer) checks done here.
_NUMBERS = {
    "temperature": ("temperature", 0.0, 2.0, False),
    "top_p": ("top_p", 0.0, 1.0, False),
    "presence_penalty": ("presence_penalty", -2.0, 2.0, False),
    "frequency_penalty": ("frequency_penalty", -2.0, 2.0, False),
    "top_logprobs": ("top_logprobs", 0, 20, True),
    # common server extensions (vLLM spellings)
    "top_k": ("top_k", 0, 1 << 30, True),
    "min_p": ("min_p", 0.0, 1.0, False),
    "repetition_penalty": ("repetition_penalty", 0.01, 100.0, False),
    "min_tokens": ("min_tokens", 0, 1 << 30, True),
    "reasoning_budget_tokens": ("reasoning_budget_tokens", 0, 1 << 30, True),
}


_TIERS = ("auto", "default", "flex", "scale", "priority")


def _ignored(body: Obj) -> None:
    """Documented fields with no meaning here, type-checked and ignored: ``service_tier``,
    ``store``, ``metadata`` (at most 16 string values), ``prompt_cache_key`` and
    ``safety_identifier``."""
    tier = body.get("service_tier", "string")
    if tier is not None and tier not in _TIERS:
        raise InvalidValueError("service_tier", tier, f"must be one of {', '.join(_TIERS)}")
    body.get("store", "boolean")
    metadata = body.get("metadata", "object")
    if metadata is not None:
        if len(metadata) > 16:
            raise InvalidValueError("metadata", len(metadata), "at most 16 entries")
        for key, value in metadata.items():
            check(f"metadata.{key}", value, "string")
    body.get("prompt_cache_key", "string")
    body.get("safety_identifier", "string")


def _tool_call(path: str, raw: Any) -> ToolCall:
    o = Obj(raw, path)
    kind = o.get("type", "string", "function")
    if kind != "function":
        raise InvalidValueError(f"{path}.type", kind, "only function tool calls exist")
    fn = o.obj("function")
    if fn is None:
        raise InvalidValueError(f"{path}.function", None, "is required")
    call = ToolCall(fn.need("name", "string"), fn.get("arguments", "string", "{}"),
                    o.get("id", "string"))
    fn.done()
    o.done()
    return call


def _message(path: str, raw: Any) -> Message:
    o = Obj(raw, path)
    role = o.need("role", "string")
    if role not in _ROLES:
        raise InvalidValueError(f"{path}.role", role, f"must be one of {', '.join(_ROLES)}")
    content = text_content(f"{path}.content", o.value.get("content"), "text")
    o.has("content")
    calls = [_tool_call(p, c) for p, c in o.items("tool_calls")]
    if calls and role != "assistant":
        raise InvalidValueError(f"{path}.tool_calls", len(calls), "only assistant messages call tools")
    call_id = o.get("tool_call_id", "string")
    if role == "tool" and call_id is None:
        raise InvalidValueError(f"{path}.tool_call_id", None, "a tool message needs it")
    if content is None and not calls:
        raise InvalidValueError(f"{path}.content", None, "is required")
    message = Message(role, content, calls, call_id, o.get("reasoning_content", "string"),
                      o.get("name", "string"))
    o.done()
    return message


def _tools(body: Obj) -> list[ToolSpec]:
    tools = []
    for path, raw in body.items("tools"):
        o = Obj(raw, path)
        if o.need("type", "string") != "function":
            raise InvalidValueError(f"{path}.type", o.value["type"], "must be 'function'")
        fn = o.obj("function")
        if fn is None:
            raise InvalidValueError(f"{path}.function", None, "is required")
        tools.append(ToolSpec(fn.need("name", "string"), fn.get("description", "string", ""),
                              fn.get("parameters", "object", {"type": "object", "properties": {}})))
        fn.get("strict", "boolean")
        fn.done()
        o.done()
    return tools


def _tool_choice(body: Obj, tools: list[ToolSpec]) -> tuple[list[ToolSpec], str | None]:
    """The tools the template sees (none, all, or the one a named choice picks), and the
    tool call the output must open (``""``: any; None: not required)."""
    choice = body.value.get("tool_choice")
    body.has("tool_choice")
    if choice is None or choice == "auto":
        return tools, None
    if choice == "required":
        if not tools:
            raise InvalidValueError("tool_choice", choice, "requires 'tools'")
        return tools, ""
    if choice == "none":
        return [], None
    o = Obj(choice, "tool_choice")
    fn = o.obj("function")
    if o.need("type", "string") != "function" or fn is None:
        raise InvalidValueError("tool_choice", choice,
                                "must be 'none', 'auto', 'required' or a named function")
    name = fn.need("name", "string")
    fn.done()
    o.done()
    picked = [t for t in tools if t.name == name]
    if not picked:
        raise InvalidValueError("tool_choice.function.name", name, "names no tool in 'tools'")
    return picked, name


def _config(body: Obj, defaults: ServerDefaults) -> tuple[GenerationConfig, bool]:
    fields: dict[str, Any] = {}
    for name, (target, lo, hi, integer) in _NUMBERS.items():
        value = body.num(name, lo, hi, integer=integer)
        if value is not None:
            fields[target] = value
    tokens = body.num("max_completion_tokens", 1, 1 << 30, integer=True)
    legacy = body.num("max_tokens", 1, 1 << 30, integer=True)
    given = tokens if tokens is not None else legacy
    n = body.num("n", 1, 1 << 30, integer=True)
    if n not in (None, 1):
        raise InvalidValueError("n", n, "only n=1 is supported")
    seed = body.get("seed", "integer")
    if seed is not None:
        fields["seed"] = seed % (1 << 63)  # OpenAI allows negative seeds; map them in range
    stop = body.value.get("stop")
    body.has("stop")
    if stop is not None:
        fields["stop"] = [check("stop", stop, "string")] if isinstance(stop, str) else [
            check(f"stop[{i}]", s, "string") for i, s in enumerate(check("stop", stop, "array"))]
    bias = body.get("logit_bias", "object")
    if bias is not None:
        fields["logit_bias"] = {k: check(f"logit_bias.{k}", v, "number") for k, v in bias.items()}
    if body.get("logprobs", "boolean"):
        fields["logprobs"] = True
    return config_from(fields, given, defaults), given is not None


def parse_chat(raw: Any, defaults: ServerDefaults) -> Parsed:
    """A chat-completions body → the internal request and how to answer it."""
    body = Obj(raw, "body")
    model = body.need("model", "string")
    messages = [_message(p, m) for p, m in body.items("messages", required=True)]
    if not messages:
        raise InvalidValueError("messages", [], "at least one message is required")
    tools, forced = _tool_choice(body, _tools(body))
    body.get("parallel_tool_calls", "boolean")
    config, given = _config(body, defaults)
    stream = body.get("stream", "boolean", False)
    options = body.obj("stream_options")
    include_usage = False
    if options is not None and not stream:
        raise InvalidValueError("stream_options", options.value, "only allowed with stream=true")
    if options is not None:
        include_usage = options.get("include_usage", "boolean", False)
        options.done()
    user = body.get("user", "string")
    _ignored(body)
    body.done()
    request = Request(messages=messages, generation_config=config, tool_catalog=tools,
                      request_id=f"chatcmpl-{uuid.uuid4().hex[:24]}",
                      client_metadata={"user": user} if user else {})
    return Parsed(model, request, stream, given, bool(tools), include_usage, forced_tool=forced)


# --- responses -----------------------------------------------------------------------------


def finish_reason(completion: Completion, tool_calls: bool) -> str:
    """OpenAI's word for why it ended (``tool_calls`` when the answer called tools)."""
    reason = completion.finish_reason
    if tool_calls and reason in (FinishReason.EOS, FinishReason.STOP_TOKEN):
        return "tool_calls"
    if reason is FinishReason.DEADLINE:
        return "length"
    return "error" if reason is FinishReason.ERROR else reason.openai


def _token(tokenizer: Tokenizer, token_id: int) -> dict[str, Any]:
    """``{"token", "bytes"}`` of one token: its exact bytes, and as text with a partial UTF-8
    character's bytes as ``\\xNN`` escapes (as OpenAI writes them)."""
    data = tokenizer.token_bytes(token_id)
    return {"token": token_text(data), "bytes": list(data)}


def _entry(tokenizer: Tokenizer, lp: TokenLogprob) -> dict[str, Any]:
    if lp.text is not None and lp.token_bytes is not None:
        token: dict[str, Any] = {"token": lp.text, "bytes": list(lp.token_bytes)}
    else:
        token = _token(tokenizer, lp.token_id)
    return {**token, "logprob": lp.logprob}


def logprobs_body(tokenizer: Tokenizer, items: Sequence[TokenLogprob]) -> dict[str, Any]:
    """``{"content": [...]}`` with each token's text, bytes, logprob and top alternatives."""
    return {"content": [
        {**_entry(tokenizer, lp), "top_logprobs": [_entry(tokenizer, t) for t in lp.top]}
        for lp in items]}


def _calls_json(calls: Sequence[ToolCallPart]) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def usage_body(completion: Completion) -> dict[str, Any]:
    """The ``usage`` object."""
    u = completion.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def chat_completion(parsed: Parsed, completion: Completion, parts: Sequence[Part],
                    tokenizer: Tokenizer) -> dict[str, Any]:
    """The non-stream response body."""
    text = "".join(p.text for p in parts if isinstance(p, TextPart) and p.kind == "text")
    thinking = "".join(p.text for p in parts if isinstance(p, TextPart) and p.kind == "thinking")
    calls = [p for p in parts if isinstance(p, ToolCallPart)]
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if thinking:
        message["reasoning_content"] = thinking
    if calls:
        message["tool_calls"] = _calls_json(calls)
    logprobs = (logprobs_body(tokenizer, completion.logprobs)
                if completion.logprobs is not None else None)
    return {"id": completion.request_id, "object": "chat.completion", "created": int(time.time()),
            "model": parsed.model, "choices": [{
                "index": 0, "message": message, "logprobs": logprobs,
                "finish_reason": finish_reason(completion, bool(calls))}],
            "usage": usage_body(completion)}


class ChatStream:
    """The ``chat.completion.chunk`` events of one streamed answer, as SSE bytes."""

    def __init__(self, parsed: Parsed, request_id: str, tokenizer: Tokenizer) -> None:
        self.parsed = parsed
        self._head = {"id": request_id, "object": "chat.completion.chunk",
                      "created": int(time.time()), "model": parsed.model}
        self._tokenizer = tokenizer
        self._calls = 0

    def _chunk(self, delta: dict[str, Any], logprobs: Any = None,
               finish: str | None = None) -> bytes:
        body: dict[str, Any] = {**self._head, "choices": [
            {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if self.parsed.include_usage:
            body["usage"] = None
        return encode(SSEEvent(json.dumps(body, ensure_ascii=False)))

    def start(self) -> bytes:
        """The first chunk: the assistant role."""
        return self._chunk({"role": "assistant", "content": ""})

    def delta(self, parts: Sequence[Part], delta: Delta) -> bytes:
        """Chunks for the parts one engine delta produced (its logprobs ride on the first)."""
        out: list[bytes] = []
        logprobs = (logprobs_body(self._tokenizer, delta.logprobs)
                    if self.parsed.request.generation_config.logprobs and delta.logprobs
                    else None)
        for part in parts:
            if isinstance(part, ToolCallPart):
                self._calls += 1
                out.append(self._chunk({"tool_calls": [{
                    "index": part.index, "id": part.id, "type": "function",
                    "function": {"name": part.name, "arguments": ""}}]}))
                out.append(self._chunk({"tool_calls": [{
                    "index": part.index, "function": {"arguments": part.arguments}}]}))
            else:
                key = "content" if part.kind == "text" else "reasoning_content"
                out.append(self._chunk({key: part.text}, logprobs))
                logprobs = None
        if logprobs is not None:
            out.append(self._chunk({"content": ""}, logprobs))
        return b"".join(out)

    def end(self, completion: Completion) -> bytes:
        """The finishing chunk, the usage chunk if asked, and ``[DONE]``."""
        out = [self._chunk({}, finish=finish_reason(completion, self._calls > 0))]
        if self.parsed.include_usage:
            body = {**self._head, "choices": [], "usage": usage_body(completion)}
            out.append(encode(SSEEvent(json.dumps(body))))
        out.append(encode(SSEEvent("[DONE]")))
        return b"".join(out)
