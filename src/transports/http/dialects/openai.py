"""The OpenAI dialect: ``POST /v1/chat/completions`` bodies in, completions and chunks out.

Owns :func:`parse_chat` (a request body → :class:`~transports.http.dialects.common.Parsed`, every field
type- and range-checked, unknown fields refused, documented ones without meaning here left to
:mod:`~transports.http.dialects.documented`), :func:`chat_completion` (the non-stream body, one choice
per generation) and :class:`ChatStream` (the ``chat.completion.chunk`` sequence, choices
interleaved by ``index``, ``data: [DONE]`` last). Tool calls found in the output become
``tool_calls`` (streamed as deltas: id and name first, then the arguments) and
``finish_reason: "tool_calls"``. The usage object, the word for a finish reason and
``stream_options`` are shared with :mod:`~transports.http.dialects.completions`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from pipeline.errors import InvalidValueError
from pipeline.contracts.text import Tokenizer
from pipeline.contracts.output import (
    Completion, Delta, FinishReason, TokenLogprob, ToolCallDelta, ToolCallEnd, Usage, token_text,
)
from pipeline.contracts.request import (
    GenerationConfig, Message, Request, ToolCall, ToolChoice, ToolSpec,
)
from transports.http.server.choices import total_usage
from transports.http.dialects.common import (
    Parsed, ServerDefaults, config_from, sampling_given, text_content,
)
from transports.http.dialects.documented import (
    openai_chat_ignored, openai_chat_refused, openai_ignored, response_format,
    structured_outputs,
)
from transports.http.dialects.documents import Document, file_data
from transports.http.dialects.fields import Obj, check
from transports.http.dialects.spec import CHAT_SAMPLING, Spec, read, unsupported
from pipeline.output_parts import calls_of
from pipeline.contracts.output import Part, TextPart
from transports.sse import SSEEvent, encode

_ROLES = ("system", "developer", "user", "assistant", "tool")


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


def file_part(part: Obj) -> Document:
    """An OpenAI ``file`` content part (``file.file_data``: base64 or a data URL, with
    ``file.filename``) as a document; ``file_id`` names an uploaded file, which this server
    does not keep."""
    file = part.obj("file")
    if file is None:
        raise InvalidValueError(part.at("file"), None, "is required")
    name = file.get("filename", "string")
    if file.has("file_id"):
        raise unsupported(file.at("file_id"), file.value["file_id"], "uploaded files: send "
                          "the file's bytes as file_data")
    document = file_data(file, name)
    file.done()
    return document


def _message(path: str, raw: Any, documents: list[Document]) -> Message:
    o = Obj(raw, path)
    role = o.need("role", "string")
    if role not in _ROLES:
        raise InvalidValueError(f"{path}.role", role, f"must be one of {', '.join(_ROLES)}")
    content = text_content(f"{path}.content", o.value.get("content"), "text",
                           files=file_part if role == "user" else None, documents=documents)
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


def _tool_choice(body: Obj, tools: list[ToolSpec]) -> ToolChoice:
    """``tool_choice`` and ``parallel_tool_calls``, and whether a tool is ``strict``."""
    choice = body.value.get("tool_choice")
    body.has("tool_choice")
    parallel = body.get("parallel_tool_calls", "boolean", True)
    strict = any(isinstance(t, dict) and isinstance(t.get("function"), dict)
                 and t["function"].get("strict") is True for t in body.value.get("tools") or [])
    if choice is None or choice in ("auto", "none", "required"):
        kind = "auto" if choice is None else choice
        if kind == "required" and not tools:
            raise InvalidValueError("tool_choice", choice, "requires 'tools'")
        return ToolChoice(kind, parallel=parallel, strict=strict)
    o = Obj(choice, "tool_choice")
    fn = o.obj("function")
    if o.need("type", "string") != "function" or fn is None:
        raise InvalidValueError("tool_choice", choice,
                                "must be 'none', 'auto', 'required' or a named function")
    name = fn.need("name", "string")
    fn.done()
    o.done()
    if not any(t.name == name for t in tools):
        raise InvalidValueError("tool_choice.function.name", name, "names no tool in 'tools'")
    return ToolChoice("tool", name, parallel=parallel, strict=strict)


def sampling(body: Obj, numbers: Mapping[str, Spec] = CHAT_SAMPLING) -> dict[str, Any]:
    """The sampling fields both OpenAI endpoints share, as GenerationConfig fields: the
    ``numbers`` (a table of :mod:`~transports.http.dialects.spec`), ``seed``, ``stop`` and
    ``logit_bias``."""
    fields = read(body, numbers)
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
    return fields


def _config(body: Obj, defaults: ServerDefaults) -> tuple[GenerationConfig, bool, str]:
    """The generation config, whether the body set its budget, and the budget's field name."""
    fields = sampling(body)
    tokens = body.num("max_completion_tokens", 1, 1 << 30, integer=True)
    legacy = body.num("max_tokens", 1, 1 << 30, integer=True)
    given = tokens if tokens is not None else legacy
    if body.get("logprobs", "boolean"):
        fields["logprobs"] = True
    field = "max_completion_tokens" if tokens is not None else "max_tokens"
    return config_from(fields, given, defaults), given is not None, field


def choice_count(body: Obj) -> int:
    """``n``: how many choices (the server's ``max_n`` bounds it at the door)."""
    return body.num("n", 1, 1 << 30, 1, integer=True)  # type: ignore[no-any-return]


def stream_options(body: Obj, stream: bool) -> bool:
    """``stream_options`` (only with ``stream``): whether to send the usage chunk."""
    options = body.obj("stream_options")
    if options is None:
        return False
    if not stream:
        raise InvalidValueError("stream_options", options.value, "only allowed with stream=true")
    include_usage = options.get("include_usage", "boolean", False)
    options.get("include_obfuscation", "boolean")  # padding against side channels: none here
    options.done()
    return include_usage  # type: ignore[no-any-return]


def parse_chat(raw: Any, defaults: ServerDefaults) -> Parsed:
    """A chat-completions body → the internal request and how to answer it."""
    body = Obj(raw, "body")
    model = body.need("model", "string")
    documents: list[Document] = []
    messages = [_message(p, m, documents) for p, m in body.items("messages", required=True)]
    if not messages:
        raise InvalidValueError("messages", [], "at least one message is required")
    tools = _tools(body)
    choice = _tool_choice(body, tools)
    config, given, budget_field = _config(body, defaults)
    n = choice_count(body)
    stream = body.get("stream", "boolean", False)
    include_usage = stream_options(body, stream)
    user = body.get("user", "string")
    openai_ignored(body)
    effort = openai_chat_ignored(body)
    openai_chat_refused(body)
    grammar = structured_outputs(body, response_format(body))
    body.done()
    config = attrs.evolve(config, grammar=grammar)
    thinking = {} if effort is None else {"enable_thinking": effort != "none"}
    request = Request(messages=messages, generation_config=config, tool_catalog=tools,
                      tool_choice=choice, request_id=f"chatcmpl-{uuid.uuid4().hex[:24]}",
                      client_metadata={"user": user} if user else {},
                      template_kwargs=thinking)
    return Parsed(model, request, stream, given, bool(request.tools_shown), include_usage, n=n,
                  sampling_given=sampling_given(raw), budget_field=budget_field,
                  documents=tuple(documents))


# --- responses -----------------------------------------------------------------------------


def finish_word(reason: FinishReason, tool_calls: bool) -> str:
    """OpenAI's word for why a choice ended (``tool_calls`` when it called tools)."""
    if tool_calls and reason in (FinishReason.EOS, FinishReason.STOP_TOKEN):
        return "tool_calls"
    if reason is FinishReason.DEADLINE:
        return "length"
    return "error" if reason is FinishReason.ERROR else reason.openai


def token_of(tokenizer: Tokenizer, lp: TokenLogprob) -> tuple[str, bytes]:
    """A logprob record's token as text and exact bytes: the record's own, else from the
    tokenizer (the text shows a partial UTF-8 character's bytes as ``\\xNN`` escapes, as
    OpenAI writes them). Both OpenAI endpoints show tokens this way."""
    if lp.text is not None and lp.token_bytes is not None:
        return lp.text, lp.token_bytes
    data = tokenizer.token_bytes(lp.token_id)
    return token_text(data), data


def _entry(tokenizer: Tokenizer, lp: TokenLogprob) -> dict[str, Any]:
    text, data = token_of(tokenizer, lp)
    return {"token": text, "bytes": list(data), "logprob": lp.logprob}


def logprobs_body(tokenizer: Tokenizer, items: Sequence[TokenLogprob]) -> dict[str, Any]:
    """``{"content": [...]}`` with each token's text, bytes, logprob and top alternatives."""
    return {"content": [
        {**_entry(tokenizer, lp), "top_logprobs": [_entry(tokenizer, t) for t in lp.top]}
        for lp in items]}


def _calls_json(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def _call_delta(part: ToolCallDelta) -> dict[str, Any]:
    """A ``tool_calls`` delta entry: the call's id and name first, then argument fragments."""
    if part.name is not None:
        return {"index": part.index, "id": part.id, "type": "function",
                "function": {"name": part.name, "arguments": part.arguments}}
    return {"index": part.index, "function": {"arguments": part.arguments}}


def usage_body(usage: Usage) -> dict[str, Any]:
    """The ``usage`` object."""
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def _choice(index: int, completion: Completion, parts: Sequence[Part],
            tokenizer: Tokenizer) -> dict[str, Any]:
    text = "".join(p.text for p in parts if isinstance(p, TextPart) and p.kind == "text")
    thinking = "".join(p.text for p in parts if isinstance(p, TextPart) and p.kind == "thinking")
    calls = [end.call for end in calls_of(list(parts)) if end.call is not None]
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if thinking:
        message["reasoning_content"] = thinking
    if calls:
        message["tool_calls"] = _calls_json(calls)
    logprobs = (logprobs_body(tokenizer, completion.logprobs)
                if completion.logprobs is not None else None)
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": finish_word(completion.finish_reason, bool(calls))}


def chat_completion(parsed: Parsed, completions: Sequence[Completion],
                    parts: Sequence[Sequence[Part]], usage: Usage,
                    tokenizer: Tokenizer) -> dict[str, Any]:
    """The non-stream response body: one choice per completion, with its parts."""
    return {"id": parsed.request.request_id, "object": "chat.completion",
            "created": int(time.time()), "model": parsed.model,
            "choices": [_choice(i, c, p, tokenizer)
                        for i, (c, p) in enumerate(zip(completions, parts, strict=True))],
            "usage": usage_body(usage)}


class ChatStream:
    """The ``chat.completion.chunk`` events of one streamed answer, as SSE bytes: each
    choice's chunks carry its ``index``, its finish chunk follows its last delta, and the
    usage chunk (if asked) and ``[DONE]`` close the stream."""

    def __init__(self, parsed: Parsed, request_id: str, tokenizer: Tokenizer) -> None:
        self.parsed = parsed
        self._head = {"id": request_id, "object": "chat.completion.chunk",
                      "created": int(time.time()), "model": parsed.model}
        self._tokenizer = tokenizer
        self._calls = [0] * parsed.n

    def _chunk(self, index: int, delta: dict[str, Any], logprobs: Any = None,
               finish: str | None = None) -> bytes:
        body: dict[str, Any] = {**self._head, "choices": [
            {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if self.parsed.include_usage:
            body["usage"] = None
        return encode(SSEEvent(json.dumps(body, ensure_ascii=False)))

    def start(self) -> bytes:
        """The first chunk of every choice: the assistant role."""
        return b"".join(self._chunk(i, {"role": "assistant", "content": ""})
                        for i in range(self.parsed.n))

    def delta(self, index: int, parts: Sequence[Part], delta: Delta) -> bytes:
        """Chunks for the parts one engine delta of choice ``index`` produced (its logprobs
        ride on the first), and the choice's finish chunk after its final delta."""
        out: list[bytes] = []
        logprobs = (logprobs_body(self._tokenizer, delta.logprobs)
                    if self.parsed.request.generation_config.logprobs and delta.logprobs
                    else None)
        for part in parts:
            if isinstance(part, ToolCallEnd):
                self._calls[index] += part.call is not None
            elif isinstance(part, ToolCallDelta):
                out.append(self._chunk(index, {"tool_calls": [_call_delta(part)]}))
            else:
                key = "content" if part.kind == "text" else "reasoning_content"
                out.append(self._chunk(index, {key: part.text}, logprobs))
                logprobs = None
        if logprobs is not None:
            out.append(self._chunk(index, {"content": ""}, logprobs))
        reason = delta.finish_reason
        if reason is not None and reason is not FinishReason.ERROR:  # a failure ends the stream
            out.append(self._chunk(index, {}, finish=finish_word(reason, self._calls[index] > 0)))
        return b"".join(out)

    def end(self, completions: Sequence[Completion]) -> bytes:
        """The usage chunk if asked (each prompt once, completions summed), and ``[DONE]``."""
        return stream_end(self._head, self.parsed.include_usage, self.parsed.n, completions)


def stream_end(head: dict[str, Any], include_usage: bool, n: int,
               completions: Sequence[Completion]) -> bytes:
    """The end of an OpenAI stream (chat or legacy completions): the usage chunk when
    ``stream_options.include_usage`` asked for it (each prompt once, completions summed over
    the ``n`` choices), then ``data: [DONE]``."""
    out = []
    if include_usage:
        body = {**head, "choices": [], "usage": usage_body(total_usage(completions, n))}
        out.append(encode(SSEEvent(json.dumps(body))))
    out.append(encode(SSEEvent("[DONE]")))
    return b"".join(out)
