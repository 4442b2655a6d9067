"""OpenAI's Responses API, the request side: ``POST /v1/responses`` bodies in, the chat
request they amount to out.

Owns :func:`parse_responses` (a body → the chat flow's :class:`~transports.http.dialects.common.Parsed`
plus a :class:`~transports.http.dialects.responses_output.ResponsesForm` that answers in this API's
shape: the ``response`` object, its event stream and the kept conversations are
:mod:`transports.http.dialects.responses_output`'s).

A Responses request is translated, not served by a flow of its own: ``instructions`` become
a system message first, ``input`` (a string, or items: messages of role ``user``,
``system``, ``developer`` or ``assistant`` with string or ``input_text`` / ``output_text``
content, ``function_call`` items joined to the assistant turn before them,
``function_call_output`` items as tool messages; ``reasoning`` items are accepted and
dropped) the chat messages after those of the previous response; function ``tools``
(name, description, parameters and ``strict`` at the tool's top level; ``strict`` defaults to
true, as in OpenAI's API), ``tool_choice``, ``parallel_tool_calls``, ``max_output_tokens``,
``temperature``, ``top_p`` and ``text.format`` (``json_schema`` or ``json_object``, the grammar
``response_format`` gives chat) become the request chat completions would have made. So the
gateway, admission, window fit, cancellation, usage row and trace are the chat endpoint's,
and the answer's parts (text, ``<think>`` reasoning, tool calls, split by
:mod:`pipeline.output_parts`) become output items: ``reasoning``, ``message`` (one
``output_text`` part) and ``function_call`` (a malformed call stays an item with status
``incomplete``, its text following as a message). A response cut by ``max_output_tokens``
(or the request deadline) is ``incomplete`` with ``incomplete_details.reason``
``max_output_tokens``.

**Kept responses.** With ``store`` (the default) a finished response's conversation (the
previous response's, this input, this output; never the ``instructions``, which OpenAI does
not carry over) is kept in memory for ``previous_response_id``: the last ``capacity``
responses, each readable only with a key that made it (as traces are,
:mod:`transports.http.accounting.traces`). An id unknown, dropped, not stored, or made with another key
is a 400 naming ``previous_response_id``.

**Bounds at the door** (:mod:`transports.http.server.limits`): input items plus their content parts
(with the previous response's messages) within ``max_messages``, the text of ``input``,
``instructions`` and ``tools`` within ``max_prompt_chars``, ``text.format.schema`` within
``max_tool_schema_bytes``; ``tools`` are counted and sized by the door's own check.
Documented fields this server cannot honour (``background``, ``conversation``, ``prompt``,
``include``, ``truncation: auto``, ``max_tool_calls``, ``top_logprobs``, tools other than
functions, images and files) are 400s saying so; undocumented ones are unknown fields.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import attrs

from pipeline.errors import InvalidValueError, LimitExceededError
from pipeline.grammar import Grammar
from pipeline.contracts.request import Message, Request, ToolCall, ToolChoice, ToolSpec
from transports.http.dialects.common import Parsed, ServerDefaults, config_from, sampling_given
from transports.http.dialects.documented import openai_ignored
from transports.http.dialects.documents import Document, file_data
from transports.http.dialects.fields import Obj, check
from transports.http.dialects.spec import RESPONSES_SAMPLING, one_of, unsupported
from transports.http.server.limits import Limits, text_chars
from transports.http.dialects.openai import sampling
from transports.http.dialects.responses_output import Conversations, Echo, ResponsesForm

_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text")
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


# --- request ---------------------------------------------------------------------------------


def _file(part: Obj) -> Document:
    """An ``input_file`` part (``file_data``: base64 or a data URL, with ``filename``) as a
    document; a ``file_id`` or ``file_url`` names a file this server does not fetch."""
    for field in ("file_id", "file_url"):
        if part.has(field):
            raise unsupported(part.at(field), part.value[field], "files by id or URL: send the "
                              "file's bytes as file_data")
    return file_data(part, part.get("filename", "string"))


def _text(path: str, value: Any, role: str, documents: list[Document] | None = None) -> str:
    """Message content as text: a string, or ``input_text`` / ``output_text`` parts (and
    ``refusal`` parts of an assistant message, ``input_file`` parts of a user's, read to
    text and noted in ``documents``)."""
    if isinstance(value, str):
        return value
    pieces = []
    for i, raw in enumerate(check(path, value, "array")):
        part = Obj(raw, f"{path}[{i}]")
        kind = part.need("type", "string")
        if kind == "refusal" and role == "assistant":
            pieces.append(part.need("refusal", "string"))
        elif kind in _TEXT_PARTS:
            pieces.append(part.need("text", "string"))
            part.get("annotations", "array")
            part.get("logprobs", "array")
        elif kind == "input_file" and role == "user" and documents is not None:
            document = _file(part)
            documents.append(document)
            pieces.append(f"\n{document.block}\n")
        else:
            raise unsupported(part.at("type"), kind, "only text and a user's files go in "
                                                     "('input_text', 'output_text' and "
                                                     "'input_file' parts)")
        part.done()
    return "".join(pieces)


def _message(o: Obj, documents: list[Document]) -> Message:
    role = o.need("role", "string")
    if role not in _ROLES:
        raise InvalidValueError(o.at("role"), role, f"must be one of {', '.join(_ROLES)}")
    if "content" not in o.value or o.value["content"] is None:
        raise InvalidValueError(o.at("content"), None, "is required")
    content = _text(o.at("content"), o.value["content"], role, documents)
    o.has("content")
    o.get("id", "string")
    one_of(o, "status", ("in_progress", "completed", "incomplete"))
    one_of(o, "phase", ("commentary", "final_answer"))
    return Message(role, content)


def _call(o: Obj) -> ToolCall:
    call = ToolCall(o.need("name", "string"), o.need("arguments", "string"),
                    o.need("call_id", "string"))
    o.get("id", "string")
    one_of(o, "status", ("in_progress", "completed", "incomplete"))
    o.get("namespace", "string")
    return call


def _call_output(o: Obj) -> Message:
    call_id = o.need("call_id", "string")
    if "output" not in o.value or o.value["output"] is None:
        raise InvalidValueError(o.at("output"), None, "is required")
    output = _text(o.at("output"), o.value["output"], "tool")
    o.has("output")
    o.get("id", "string")
    one_of(o, "status", ("in_progress", "completed", "incomplete"))
    return Message("tool", output, tool_call_id=call_id)


def _reasoning_item(o: Obj) -> None:
    """A ``reasoning`` item sent back: checked, then dropped (templates keep no reasoning of
    earlier turns, and no encrypted reasoning exists here)."""
    o.get("id", "string")
    o.get("summary", "array")
    o.get("content", "array")
    o.get("encrypted_content", "string")
    one_of(o, "status", ("in_progress", "completed", "incomplete"))


def _input(body: Obj, documents: list[Document]) -> list[Message]:
    """``input``: a string (one user message) or a list of items, as chat messages."""
    value = body.value.get("input")
    body.has("input")
    if value is None:
        raise InvalidValueError("input", None, "is required")
    if isinstance(value, str):
        return [Message("user", value)]
    messages: list[Message] = []
    for path, raw in body.items("input"):
        o = Obj(raw, path)
        kind = o.get("type", "string", "message")
        if kind == "message":
            messages.append(_message(o, documents))
        elif kind == "function_call":
            call = _call(o)
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":  # one assistant turn
                messages[-1] = attrs.evolve(last, tool_calls=(*last.tool_calls, call))
            else:
                messages.append(Message("assistant", None, (call,)))
        elif kind == "function_call_output":
            messages.append(_call_output(o))
        elif kind == "reasoning":
            _reasoning_item(o)
        else:
            raise unsupported(o.at("type"), kind, "only message, function_call, "
                              "function_call_output and reasoning items go in")
        o.done()
    if not messages:
        raise InvalidValueError("input", [], "at least one message is required")
    return messages


def _tools(body: Obj) -> tuple[list[ToolSpec], list[dict[str, Any]], bool]:
    """Function tools (Responses shape), their echo, and whether any is ``strict``."""
    tools, echo, strict = [], [], False
    for path, raw in body.items("tools"):
        o = Obj(raw, path)
        kind = o.need("type", "string")
        if kind != "function":
            raise unsupported(o.at("type"), kind, "only function tools exist here")
        spec = ToolSpec(o.need("name", "string"), o.get("description", "string", ""),
                        o.get("parameters", "object",
                              {"type": "object", "properties": {}}))
        is_strict = o.get("strict", "boolean", True)
        o.get("defer_loading", "boolean")
        o.done()
        strict = strict or is_strict
        tools.append(spec)
        echo.append({"type": "function", "name": spec.name, "description": spec.description,
                     "parameters": dict(spec.parameters), "strict": is_strict})
    return tools, echo, strict


def _tool_choice(body: Obj, tools: list[ToolSpec], strict: bool) -> tuple[ToolChoice, Any]:
    """``tool_choice`` and ``parallel_tool_calls``, and the choice's echo."""
    choice = body.value.get("tool_choice")
    body.has("tool_choice")
    parallel = body.get("parallel_tool_calls", "boolean", True)
    if choice is None or choice in ("auto", "none", "required"):
        kind = "auto" if choice is None else choice
        if kind == "required" and not tools:
            raise InvalidValueError("tool_choice", choice, "requires 'tools'")
        return ToolChoice(kind, parallel=parallel, strict=strict), kind
    o = Obj(choice, "tool_choice")
    kind = o.need("type", "string")
    if kind != "function":
        raise unsupported("tool_choice.type", kind,
                          "only 'none', 'auto', 'required' or {type: function, name}")
    name = o.need("name", "string")
    o.done()
    if not any(t.name == name for t in tools):
        raise InvalidValueError("tool_choice.name", name, "names no tool in 'tools'")
    return (ToolChoice("tool", name, parallel=parallel, strict=strict),
            {"type": "function", "name": name})


def _format(body: Obj, limits: Limits) -> tuple[Grammar | None, dict[str, Any]]:
    """``text.format`` as the request's grammar, and its echo (``text`` by default)."""
    text = body.obj("text")
    if text is None:
        return None, {"type": "text"}
    one_of(text, "verbosity", ("low", "medium", "high"))
    fmt = text.obj("format")
    text.done()
    if fmt is None:
        return None, {"type": "text"}
    kind = one_of(fmt, "type", ("text", "json_object", "json_schema"))
    if kind is None:
        raise InvalidValueError("text.format.type", None, "is required")
    echo: dict[str, Any] = {"type": kind}
    grammar = None if kind == "text" else Grammar.json_object()
    if kind == "json_schema":
        echo["name"] = fmt.need("name", "string")
        schema = fmt.need("schema", "object")
        size = len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False).encode())
        if size > limits.max_tool_schema_bytes:
            raise LimitExceededError("text.format.schema", "max_tool_schema_bytes", size,
                                     limits.max_tool_schema_bytes, "bytes of JSON schema")
        grammar = Grammar.json_schema(schema, field="text.format.schema")
        echo.update(schema=schema, strict=fmt.get("strict", "boolean", False),
                    description=fmt.get("description", "string"))
    fmt.done()
    return grammar, echo


def _refused(body: Obj) -> None:
    """Documented fields asking for what this server does not do (400 each when given)."""
    if body.get("background", "boolean"):
        raise unsupported("background", True, "responses are answered in the request")
    for name, why in (("conversation", "no server-held conversations: send "
                                       "previous_response_id"),
                      ("prompt", "no stored prompt templates"),
                      ("max_tool_calls", "no server-side tools"),
                      ("context_management", "no server-side context editing")):
        if body.has(name):
            raise unsupported(name, body.value[name], why)
    include = body.get("include", "array")
    if include:
        raise unsupported("include[0]", include[0], "no extra output data is computed")
    if one_of(body, "truncation", ("auto", "disabled")) == "auto":
        raise unsupported("truncation", "auto", "the input is never cut; a prompt over the "
                                                "window is a 400")
    top = body.num("top_logprobs", 0, 20, integer=True)
    if top:
        raise unsupported("top_logprobs", top, "no logprobs in responses")
    options = body.obj("stream_options")
    if options is not None:
        options.get("include_obfuscation", "boolean")
        options.done()


def _reasoning(body: Obj) -> str | None:
    """``reasoning.effort`` (``none`` turns the template's thinking off)."""
    reasoning = body.obj("reasoning")
    if reasoning is None:
        return None
    effort = one_of(reasoning, "effort", _EFFORTS)
    one_of(reasoning, "summary", ("auto", "concise", "detailed"))
    one_of(reasoning, "generate_summary", ("auto", "concise", "detailed"))
    reasoning.done()
    return effort


def _bound(body: dict[str, Any], limits: Limits) -> None:
    """The door's limits on what it does not know: ``input`` items and their content parts,
    and the prompt text of ``input``, ``instructions`` and ``tools``."""
    items = body.get("input")
    if isinstance(items, list):
        units = len(items) + sum(len(i["content"]) for i in items
                                 if isinstance(i, dict) and isinstance(i.get("content"), list))
        if units > limits.max_messages:
            raise LimitExceededError("input", "max_messages", units, limits.max_messages,
                                     "input items and content parts")
    chars = sum(text_chars(body.get(name)) for name in ("input", "instructions", "tools"))
    if chars > limits.max_prompt_chars:
        raise LimitExceededError("input", "max_prompt_chars", chars, limits.max_prompt_chars,
                                 "characters of prompt text")


@attrs.frozen
class Asked:
    """A Responses body, understood: the chat flow's parsed request and the form its answer
    takes."""

    parsed: Parsed
    form: ResponsesForm


def parse_responses(raw: Any, defaults: ServerDefaults, limits: Limits,
                    conversations: Conversations, keys: frozenset[str]) -> Asked:
    """A Responses body → the chat request it amounts to and how to answer it; ``keys``
    (fingerprints) read the previous response and own this one."""
    if isinstance(raw, dict):
        _bound(raw, limits)
    body = Obj(raw, "body")
    model = body.need("model", "string")
    instructions = body.get("instructions", "string")
    previous = body.get("previous_response_id", "string")
    history = conversations.messages(previous, keys) if previous is not None else ()
    documents: list[Document] = []
    messages = _input(body, documents)
    if len(history) + len(messages) > limits.max_messages:
        raise LimitExceededError("previous_response_id", "max_messages",
                                 len(history) + len(messages), limits.max_messages,
                                 "messages with the previous response's")
    tools, tools_echo, strict = _tools(body)
    choice, choice_echo = _tool_choice(body, tools, strict)
    fields = sampling(body, RESPONSES_SAMPLING)
    given = body.num("max_output_tokens", 1, 1 << 30, integer=True)
    stream = body.get("stream", "boolean", False)
    openai_ignored(body)  # service_tier, store, metadata, prompt_cache_*, safety_identifier
    store = body.get("store", "boolean", True)
    metadata = body.get("metadata", "object", {})
    user = body.get("user", "string")
    effort = _reasoning(body)
    _refused(body)
    grammar, format_echo = _format(body, limits)
    body.done()
    config = attrs.evolve(config_from(fields, given, defaults), grammar=grammar)
    system = [Message("system", instructions)] if instructions is not None else []
    request = Request(messages=[*system, *history, *messages], generation_config=config,
                      tool_catalog=tools, tool_choice=choice,
                      request_id=f"resp_{uuid.uuid4().hex}",
                      client_metadata={"user": user} if user else {},
                      template_kwargs={} if effort is None else
                      {"enable_thinking": effort != "none"})
    parsed = Parsed(model, request, stream, given is not None, bool(request.tools_shown),
                    sampling_given=sampling_given(raw), budget_field="max_output_tokens",
                    documents=tuple(documents))
    echo = Echo(instructions, given, dict(metadata), choice.parallel, previous, effort, store,
                format_echo, choice_echo, tools_echo)
    form = ResponsesForm(echo, (*history, *messages), conversations, keys)
    return Asked(parsed, form)
