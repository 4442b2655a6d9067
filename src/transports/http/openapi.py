"""The server's own OpenAPI 3.1 document, served at ``GET /openapi.json``.

Owns :func:`openapi_document`: every route :func:`~transports.http.app.create_app` registers,
with the request bodies the dialect parsers (:mod:`~transports.http.openai_api`,
:mod:`~transports.http.anthropic_api`, the token endpoints in :mod:`~transports.http.app`)
accept — types, required fields, enums and numeric ranges as the parsers and
:class:`~pipeline.types.GenerationConfig` check them, unknown fields refused
(``additionalProperties: false``), ``null`` allowed wherever a parser reads it as absent — and
the responses: 200 (JSON, or ``text/event-stream`` when ``stream`` is true) and each error
status in the dialect's body shape from :mod:`~transports.http.errors`.

Rules JSON Schema cannot state (``min_tokens`` at most the effective ``max_tokens``, token ids
below the model's vocabulary, a named tool choice naming an offered tool, the prompt fitting
the window, an integer written without a fraction: JSON Schema counts ``1.0`` as an integer,
the parsers do not) are written in descriptions; the server answers them 400. The document is
hand-written data, so a parser change needs a change here: ``tests/test_http_schemathesis.py``
fuzzes the live server against it and fails on a 5xx or a response that does not conform.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Schema = dict[str, Any]

# The parsers' upper bound on every token count and top_k (Obj.num(..., 1 << 30)).
MAX_COUNT = 1 << 30
# GenerationConfig: at most 16 stop strings, none empty.
MAX_STOPS = 16
JSON = "application/json"
SSE = "text/event-stream"
JSONL = "application/x-ndjson"
# The component names of the two error shapes.
OPENAI, ANTHROPIC = "OpenAIError", "AnthropicError"


# --- schema building blocks ------------------------------------------------------------------


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _nullable(schema: Schema) -> Schema:
    """An optional field's schema: every parser reads ``null`` as "absent"."""
    kind = schema.get("type")
    if kind == "null":
        return schema
    if isinstance(kind, str) and "const" not in schema and "enum" not in schema:
        return {**schema, "type": [kind, "null"]}
    return {"anyOf": [schema, {"type": "null"}]}


def _object(required: Schema, optional: Schema | None = None, *,
            description: str | None = None) -> Schema:
    """A request object: ``required`` keys must be present and non-null, ``optional`` ones may
    be null or absent, and any other key is a 400 (``Obj.done``)."""
    properties = {**required, **{k: _nullable(v) for k, v in (optional or {}).items()}}
    schema: Schema = {"type": "object", "properties": properties,
                      "additionalProperties": False}
    if required:
        schema["required"] = list(required)
    if description:
        schema["description"] = description
    return schema


def _out(required: Schema, optional: Schema | None = None) -> Schema:
    """A response object: open to new keys, so clients must ignore the ones they do not know."""
    return {"type": "object", "properties": {**required, **(optional or {})},
            "required": list(required)}


def _int(lo: int, hi: int = MAX_COUNT, description: str | None = None) -> Schema:
    schema: Schema = {"type": "integer", "minimum": lo, "maximum": hi}
    if description:
        schema["description"] = description
    return schema


def _num(lo: float, hi: float, *, lo_open: bool = False) -> Schema:
    low = {"exclusiveMinimum": lo} if lo_open else {"minimum": lo}
    return {"type": "number", **low, "maximum": hi}


def _array(items: Schema, **limits: int) -> Schema:
    return {"type": "array", "items": items, **limits}


STRING: Schema = {"type": "string"}
BOOLEAN: Schema = {"type": "boolean"}
OBJECT: Schema = {"type": "object"}
COUNT: Schema = {"type": "integer", "minimum": 0}
TOOL_NAME: Schema = {"type": "string", "minLength": 1}  # ToolSpec refuses an empty name
STOP_STRINGS = _array({"type": "string", "minLength": 1}, maxItems=MAX_STOPS)


# --- the OpenAI dialect's request ------------------------------------------------------------


def _openai_parts() -> dict[str, Schema]:
    """Message content, tool calls and tools of ``POST /v1/chat/completions``."""
    return {
        "OpenAITextPart": _object({"type": {"const": "text"}, "text": STRING},
                                  {"cache_control": OBJECT}),
        "OpenAIContent": {"oneOf": [STRING, _array(_ref("OpenAITextPart"))],
                          "description": "a string, or text parts joined in order"},
        "OpenAIToolCall": _object(
            {"function": _object({"name": STRING}, {"arguments": STRING})},
            {"type": {"const": "function"}, "id": STRING}),
        "OpenAITool": _object({"type": {"const": "function"}, "function": _object(
            {"name": TOOL_NAME},
            {"description": STRING, "parameters": OBJECT, "strict": BOOLEAN})}),
        "OpenAIToolChoice": {"oneOf": [
            {"type": "string", "enum": ["none", "auto", "required"]},
            _object({"type": {"const": "function"}, "function": _object({"name": STRING})},
                    description="must name a tool in `tools`")],
            "description": "`required` needs at least one tool in `tools`"},
    }


def _openai_message() -> Schema:
    """One chat message: the role decides what else it needs (``_message`` in openai_api)."""
    no_calls = {"type": "array", "maxItems": 0, "description": "only assistant messages call tools"}
    shared = {"name": STRING, "reasoning_content": STRING}
    plain = _object({"role": {"type": "string", "enum": ["system", "developer", "user"]},
                     "content": _ref("OpenAIContent")},
                    {**shared, "tool_call_id": STRING, "tool_calls": no_calls})
    tool = _object({"role": {"const": "tool"}, "content": _ref("OpenAIContent"),
                    "tool_call_id": STRING}, {**shared, "tool_calls": no_calls})
    assistant = _object({"role": {"const": "assistant"}},
                        {**shared, "content": _ref("OpenAIContent"), "tool_call_id": STRING,
                         "tool_calls": _array(_ref("OpenAIToolCall"))},
                        description="needs `content` or at least one tool call")
    assistant["anyOf"] = [
        {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
        {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array",
                                                                   "minItems": 1}}}]
    return {"oneOf": [plain, tool, assistant]}


def _sampling_openai() -> Schema:
    """The sampling fields and their ranges (``_NUMBERS`` in openai_api, then GenerationConfig)."""
    return {
        "temperature": _num(0, 2), "top_p": _num(0, 1, lo_open=True),
        "presence_penalty": _num(-2, 2), "frequency_penalty": _num(-2, 2),
        "top_logprobs": _int(0, 20, "above 0 needs `logprobs: true`"),
        "top_k": _int(0, description="0: off (an extension)"),
        "min_p": _num(0, 1), "repetition_penalty": _num(0, 100, lo_open=True),
        "min_tokens": _int(0, description="at most the effective max_tokens (an extension)"),
        "reasoning_budget_tokens": _int(0, description="caps a <think> block (an extension)"),
        "seed": {"type": "integer", "description": "any integer; taken modulo 2**63"},
        "logit_bias": {"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
                       "additionalProperties": _num(-100, 100),
                       "description": "token id (below the vocabulary size) -> bias"},
        "logprobs": BOOLEAN,
    }


def _chat_request() -> Schema:
    limits = _int(1, description="clamped to the room left in the window unless the server "
                                 "runs with --no-clamp; the server default when absent")
    return _object(
        {"model": _ref("Model"), "messages": _array(_ref("OpenAIMessage"), minItems=1)},
        {**_sampling_openai(), "max_tokens": limits, "max_completion_tokens": limits,
         "n": _int(1, 1, "only n=1 is supported"),
         "stop": {"oneOf": [{"type": "string", "minLength": 1}, STOP_STRINGS]},
         "tools": _array(_ref("OpenAITool")), "tool_choice": _ref("OpenAIToolChoice"),
         "parallel_tool_calls": BOOLEAN, "stream": BOOLEAN,
         "stream_options": _object({}, {"include_usage": BOOLEAN},
                                   description="only with `stream: true`"),
         "user": STRING})


# --- the Anthropic dialect's request ---------------------------------------------------------


def _anthropic_blocks() -> dict[str, Schema]:
    """Content blocks of ``POST /v1/messages`` by role (``_blocks`` in anthropic_api)."""
    cache = {"cache_control": OBJECT}
    text_part = _object({"type": {"const": "text"}, "text": STRING}, cache)
    return {
        "AnthropicTextPart": text_part,
        "AnthropicTextBlock": _object({"type": {"const": "text"}, "text": STRING},
                                      {**cache, "citations": {"type": "array"}}),
        "AnthropicThinkingBlock": _object({"type": {"const": "thinking"}, "thinking": STRING},
                                          {**cache, "signature": STRING}),
        "AnthropicToolUseBlock": _object(
            {"type": {"const": "tool_use"}, "id": STRING, "name": STRING, "input": OBJECT},
            {**cache, "caller": OBJECT}),
        "AnthropicToolResultBlock": _object(
            {"type": {"const": "tool_result"}, "tool_use_id": STRING},
            {**cache, "is_error": BOOLEAN,
             "content": {"oneOf": [STRING, _array(_ref("AnthropicTextPart"))]}}),
        "AnthropicUserMessage": _object({"role": {"const": "user"}, "content": {"oneOf": [
            STRING, _array({"oneOf": [_ref("AnthropicTextBlock"),
                                      _ref("AnthropicToolResultBlock")]})]}}),
        "AnthropicAssistantMessage": _object({"role": {"const": "assistant"}, "content": {
            "oneOf": [STRING, _array({"oneOf": [
                _ref("AnthropicTextBlock"), _ref("AnthropicThinkingBlock"),
                _ref("AnthropicToolUseBlock")]})]}}),
    }


def _anthropic_tools() -> dict[str, Schema]:
    return {
        "AnthropicTool": _object({"name": TOOL_NAME, "input_schema": OBJECT},
                                 {"type": {"const": "custom"}, "description": STRING,
                                  "cache_control": OBJECT}),
        "AnthropicToolChoice": {"oneOf": [
            _object({"type": {"type": "string", "enum": ["auto", "any", "none"]}},
                    {"name": STRING, "disable_parallel_tool_use": BOOLEAN},
                    description="`any` needs at least one tool in `tools`"),
            _object({"type": {"const": "tool"}, "name": STRING},
                    {"disable_parallel_tool_use": BOOLEAN},
                    description="must name a tool in `tools`")]},
        "AnthropicThinking": {"oneOf": [
            _object({"type": {"const": "enabled"}},
                    {"budget_tokens": _int(0, description="the reasoning budget")}),
            _object({"type": {"type": "string", "enum": ["disabled", "adaptive"]}})]},
    }


def _count_fields() -> tuple[Schema, Schema]:
    """What ``/v1/messages`` and ``/v1/messages/count_tokens`` share: required, optional."""
    required = {"model": _ref("Model"), "messages": _array(
        {"oneOf": [_ref("AnthropicUserMessage"), _ref("AnthropicAssistantMessage")]},
        minItems=1)}
    optional = {
        "system": {"oneOf": [STRING, _array(_ref("AnthropicTextPart"))]},
        "tools": _array(_ref("AnthropicTool")), "tool_choice": _ref("AnthropicToolChoice"),
        "temperature": _num(0, 1), "top_p": _num(0, 1, lo_open=True),
        "top_k": _int(0, description="0: off"),
        "seed": {"type": "integer", "description": "an extension; taken modulo 2**63"},
        "stop_sequences": STOP_STRINGS, "thinking": _ref("AnthropicThinking"),
    }
    return required, optional


def _messages_request() -> Schema:
    required, optional = _count_fields()
    return _object({**required, "max_tokens": _int(1, description=(
        "clamped to the room left in the window unless the server runs with --no-clamp"))},
        {**optional, "stream": BOOLEAN, "metadata": _object({}, {"user_id": STRING})})


def _count_request() -> Schema:
    required, optional = _count_fields()
    return _object(required, optional, description="a Messages body without `max_tokens`, "
                                                   "`stream` and `metadata`")


# --- the token endpoints ---------------------------------------------------------------------


def _tokenize_request() -> Schema:
    chat = _object({"model": _ref("Model"), "messages": _array(_ref("OpenAIMessage"),
                                                               minItems=1)},
                   {"add_generation_prompt": {**BOOLEAN, "default": True}},
                   description="messages through the chat template")
    text = _object({"model": _ref("Model"), "prompt": STRING}, {"messages": {"type": "null"}},
                   description="plain text, no template")
    return {"oneOf": [chat, text]}


def _detokenize_request() -> Schema:
    token = {**COUNT, "description": "below the model's vocabulary size (a 400 otherwise)"}
    return _object({"model": _ref("Model"), "tokens": _array(token)})


# --- responses -------------------------------------------------------------------------------


def _json_text(schema: Schema) -> Schema:
    """A string holding JSON that ``schema`` describes (an SSE event's ``data``)."""
    return {"type": "string", "contentMediaType": JSON, "contentSchema": schema}


def _stream_event(event: Schema, data: Schema) -> Schema:
    """One SSE event as OpenAPI before 3.2 describes a ``text/event-stream`` item: its
    ``event`` name (``message`` when the stream sends none) and its ``data`` text."""
    return {"type": "object", "required": ["event", "data"],
            "properties": {"event": event, "data": data}}


def _openai_responses() -> dict[str, Schema]:
    """``chat.completion``, and the ``chat.completion.chunk`` events of a stream."""
    token = _out({"token": STRING, "bytes": _array(_int(0, 255)), "logprob": {"type": "number"}})
    logprobs = _out({"content": _array({**token, "properties": {
        **token["properties"], "top_logprobs": _array(token)}})})
    function = _out({"name": STRING, "arguments": STRING})
    call = _out({"id": STRING, "type": {"const": "function"}, "function": function})
    message = _out({"role": {"const": "assistant"}, "content": {"type": ["string", "null"]}},
                   {"reasoning_content": STRING, "tool_calls": _array(call)})
    finish = {"type": "string", "enum": ["stop", "length", "tool_calls", "cancelled", "error"]}
    choice = _out({"index": COUNT, "message": message, "logprobs": _nullable(logprobs),
                   "finish_reason": finish})
    usage = _out({"prompt_tokens": COUNT, "completion_tokens": COUNT, "total_tokens": COUNT,
                  "prompt_tokens_details": _out({"cached_tokens": COUNT})})
    head = {"id": STRING, "created": COUNT, "model": STRING}
    # a streamed call: id, type and name first, then the arguments, each part optional
    delta_call = _out({"index": COUNT}, {"id": STRING, "type": {"const": "function"},
                                         "function": {"type": "object", "properties":
                                                      function["properties"]}})
    delta = _out({}, {"role": {"const": "assistant"}, "content": STRING,
                      "reasoning_content": STRING, "tool_calls": _array(delta_call)})
    chunk_choice = _out({"index": COUNT, "delta": delta, "logprobs": _nullable(logprobs),
                         "finish_reason": _nullable(finish)})
    return {
        "ChatCompletion": _out({**head, "object": {"const": "chat.completion"},
                                "choices": _array(choice, minItems=1, maxItems=1),
                                "usage": usage}),
        # the usage chunk (stream_options.include_usage) has no choices
        "ChatCompletionChunk": _out({**head, "object": {"const": "chat.completion.chunk"},
                                     "choices": _array(chunk_choice, maxItems=1)},
                                    {"usage": _nullable(usage)}),
        "ChatStreamEvent": _stream_event({"const": "message"}, {"anyOf": [
            {"const": "[DONE]"},
            _json_text({"anyOf": [_ref("ChatCompletionChunk"), _ref(OPENAI)]})]}),
    }


STOP_REASON: Schema = {"type": "string", "enum": [
    "end_turn", "max_tokens", "stop_sequence", "tool_use", "refusal"]}


def _anthropic_events() -> list[Schema]:
    """The ``data`` of each Messages stream event, by its ``type`` (which is the event name)."""

    def event(kind: str, **fields: Schema) -> Schema:
        return _out({"type": {"const": kind}, **fields})

    start = _out({"id": STRING, "type": {"const": "message"}, "role": {"const": "assistant"},
                  "content": {"type": "array", "maxItems": 0}, "model": STRING,
                  "stop_reason": {"type": "null"}, "stop_sequence": {"type": "null"},
                  "usage": _out({"input_tokens": COUNT, "output_tokens": COUNT})})
    delta = {"oneOf": [event("text_delta", text=STRING),
                       event("thinking_delta", thinking=STRING),
                       event("input_json_delta", partial_json=STRING)]}
    stop = _out({"stop_reason": STOP_REASON, "stop_sequence": {"type": ["string", "null"]}})
    return [
        event("message_start", message=start),
        event("content_block_start", index=COUNT, content_block=_ref("AnthropicResponseBlock")),
        event("content_block_delta", index=COUNT, delta=delta),
        event("content_block_stop", index=COUNT),
        event("message_delta", delta=stop, usage=_out({"output_tokens": COUNT})),
        event("message_stop"), event("ping"), _ref(ANTHROPIC),
    ]


def _anthropic_responses() -> dict[str, Schema]:
    """The Messages answer, its stream's events, and the token count."""
    names = ["message_start", "content_block_start", "content_block_delta",
             "content_block_stop", "message_delta", "message_stop", "ping", "error"]
    usage = _out({"input_tokens": COUNT, "output_tokens": COUNT,
                  "cache_read_input_tokens": COUNT})
    return {
        "AnthropicResponseBlock": {"oneOf": [
            _out({"type": {"const": "text"}, "text": STRING}),
            _out({"type": {"const": "thinking"}, "thinking": STRING, "signature": STRING}),
            _out({"type": {"const": "tool_use"}, "id": STRING, "name": STRING,
                  "input": OBJECT})]},
        "Message": _out({
            "id": STRING, "type": {"const": "message"}, "role": {"const": "assistant"},
            "model": STRING, "content": _array(_ref("AnthropicResponseBlock")),
            "stop_reason": STOP_REASON, "stop_sequence": {"type": ["string", "null"]},
            "usage": usage}),
        "MessageStreamEvent": _stream_event({"type": "string", "enum": names},
                                            _json_text({"oneOf": _anthropic_events()})),
        "InputTokens": _out({"input_tokens": COUNT}),
    }


def _other_responses() -> dict[str, Schema]:
    state = {"type": "string", "enum": ["loading", "ready", "failed", "restarting"]}
    model = _out({"id": STRING, "object": {"const": "model"}, "created": COUNT,
                  "owned_by": STRING, "state": state})
    return {
        "ModelObject": model,
        "Tokens": _out({"tokens": _array(COUNT), "count": COUNT, "max_model_len": COUNT}),
        "Text": _out({"prompt": STRING}),
        "ModelList": _out({"object": {"const": "list"}, "data": _array(model)}),
        "Health": _out({"status": {"type": "string",
                                   "enum": ["ok", "loading", "engine_stopped"]},
                        "models": {"type": "object", "additionalProperties": state}},
                       {"engine_failures": {"type": "object",
                                            "additionalProperties": STRING},
                        "restarts": {"type": "object", "additionalProperties": COUNT}}),
    }


def _error_schemas() -> dict[str, Schema]:
    """The two error shapes of ``errors.error_body``; extras (``served_models``,
    ``prompt_tokens``, ``limit``, ``requested``) ride alongside."""
    return {
        "OpenAIError": _out({"error": _out({
            "message": STRING, "type": STRING, "param": {"type": ["string", "null"]},
            "code": {"type": ["string", "null"]}})}),
        "AnthropicError": _out({"type": {"const": "error"}, "error": _out(
            {"type": STRING, "message": STRING}, {"param": STRING})}),
    }


# --- operations ------------------------------------------------------------------------------

# What each error status means here (the table in errors.py; 408 and 413 are the request
# timeout and body-size limit).
_STATUS_TEXT = {
    400: "malformed JSON, a wrong type, a value out of range, an unknown field, or a prompt "
         "over the window (`param` names the field)",
    401: "missing or wrong API key",
    404: "the model is not served (`served_models` lists the served names), or no trace "
         "of that request is kept for this key",
    408: "the request took too long",
    413: "the request body is too large",
    429: "every slot and the queue are full",
    529: "every slot and the queue are full",
    500: "internal error",
    503: "the model is still loading, or the server is shutting down",
}
GENERATION = (400, 401, 404, 408, 413, 500, 503)
# A bodiless endpoint can only fail authentication or internally.
LISTING = (401, 500)


def _json(schema: Schema, description: str) -> Schema:
    return {"description": description, "content": {JSON: {"schema": schema}}}


def _errors(shape: str, statuses: Sequence[int]) -> Schema:
    return {str(s): _json(_ref(shape), _STATUS_TEXT[s]) for s in statuses}


def _body(schema: str) -> Schema:
    return {"required": True, "content": {JSON: {"schema": _ref(schema)}}}


TRACEPARENT: Schema = {
    "name": "traceparent", "in": "header", "required": False,
    "description": "W3C trace context, carried into the request's metadata; non-zero trace "
                   "and parent ids, version not ff (a 400 otherwise)",
    "schema": {"type": "string", "pattern": (
        "^(?!ff)[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}$")}}


def _generation(summary: str, body: str, answer: str, event: str, shape: str,
                overloaded: int) -> Schema:
    # Before OpenAPI 3.2 (itemSchema), an event stream's `schema` describes each event.
    ok = {"description": "the answer; an SSE event stream when `stream` is true",
          "headers": {"x-request-id": {
              "description": "the request's id: `GET /traces/{request_id}` returns its trace",
              "schema": STRING}},
          "content": {JSON: {"schema": _ref(answer)}, SSE: {"schema": _ref(event)}}}
    return {"post": {
        "summary": summary, "parameters": [TRACEPARENT], "requestBody": _body(body),
        "responses": {"200": ok, **_errors(shape, (*GENERATION, overloaded))}}}


def _post(summary: str, body: str, answer: str, shape: str) -> Schema:
    return {"post": {"summary": summary, "requestBody": _body(body), "responses": {
        "200": _json(_ref(answer), "the answer"), **_errors(shape, GENERATION)}}}


def _open_get(summary: str, responses: Schema) -> Schema:
    """A GET that needs no key."""
    return {"get": {"summary": summary, "security": [], "responses": responses}}


def _paths() -> Schema:
    text = {"description": "Prometheus text exposition",
            "content": {"text/plain": {"schema": STRING}}}
    return {
        "/v1/chat/completions": _generation("OpenAI chat completions", "ChatCompletionRequest",
                                            "ChatCompletion", "ChatStreamEvent", OPENAI, 429),
        "/v1/messages": _generation("Anthropic Messages", "MessagesRequest", "Message",
                                    "MessageStreamEvent", ANTHROPIC, 529),
        "/v1/messages/count_tokens": _post("the prompt's exact token count",
                                           "CountTokensRequest", "InputTokens", ANTHROPIC),
        "/tokenize": _post("text or chat messages to token ids", "TokenizeRequest", "Tokens",
                           OPENAI),
        "/detokenize": _post("token ids to text", "DetokenizeRequest", "Text", OPENAI),
        "/v1/models": {"get": {"summary": "the served models and their state", "responses": {
            "200": _json(_ref("ModelList"), "the served models"), **_errors(OPENAI, LISTING)}}},
        "/v1/models/{model}": {"get": {
            "summary": "one served model", "parameters": [{
                "name": "model", "in": "path", "required": True, "schema": STRING}],
            "responses": {"200": _json(_ref("ModelObject"), "the model"),
                          **_errors(OPENAI, (*LISTING, 404))}}},
        "/health": _open_get("readiness", {
            "200": _json(_ref("Health"), "every model is loaded"),
            "503": _json(_ref("Health"), "some model is loading or failed")}),
        "/metrics": _open_get("Prometheus metrics", {"200": text}),
        "/openapi.json": _open_get("this document", {
            "200": _json({"type": "object", "required": ["openapi", "info", "paths"]},
                         "the OpenAPI document")}),
        "/traces/{request_id}": {"get": {
            "summary": "a finished request's event trace, as JSONL (`pipeline trace` reads it)",
            "description": "The traces of the last `keep_traces` finished requests are kept, "
                           "each readable only with an API key the request was made with; "
                           "for any other key, and for an unknown or evicted id, a 404. The "
                           "id is a generation response's `id` and `x-request-id` header.",
            "parameters": [{"name": "request_id", "in": "path", "required": True,
                            "schema": STRING}],
            "responses": {"200": {"description": "one JSON event per line",
                                  "content": {JSONL: {"schema": STRING}}},
                          **_errors(OPENAI, (*LISTING, 404))}}},
        "/": _open_get("the web chat page", {
            "200": {"description": "a self-contained HTML page",
                    "content": {"text/html": {"schema": STRING}}}}),
    }


def _schemas(served_models: Sequence[str]) -> Schema:
    model = {"type": "string", "enum": list(served_models),
             "description": "a served model's name; any other name is answered 404 "
                            "(`model_not_found`, with `served_models`)"}
    return {
        "Model": model, **_openai_parts(), "OpenAIMessage": _openai_message(),
        "ChatCompletionRequest": _chat_request(), **_anthropic_blocks(), **_anthropic_tools(),
        "MessagesRequest": _messages_request(), "CountTokensRequest": _count_request(),
        "TokenizeRequest": _tokenize_request(), "DetokenizeRequest": _detokenize_request(),
        **_openai_responses(), **_anthropic_responses(), **_other_responses(),
        **_error_schemas(),
    }


def openapi_document(served_models: Sequence[str]) -> dict[str, Any]:
    """The OpenAPI 3.1 document of a server serving ``served_models`` (their names)."""
    return {
        "openapi": "3.1.0",
        "info": {"title": "pipeline", "version": "1",
                 "description": "OpenAI and Anthropic dialects over one inspectable pipeline. "
                                "A null optional field is the same as an absent one. An "
                                "integer field takes a JSON integer: 1.0 or 1e3 is a 400."},
        # Either header carries the key; /health, /metrics and this document need none.
        "security": [{"bearer": []}, {"apiKey": []}],
        "paths": _paths(),
        "components": {
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}},
            "schemas": _schemas(served_models)},
    }
