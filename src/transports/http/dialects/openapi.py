"""The server's own OpenAPI 3.1 document, served at ``GET /openapi.json``.

Owns :func:`openapi_document`: every route :func:`~transports.http.server.app.create_app` registers,
with the request bodies the dialect parsers accept (:mod:`~transports.http.dialects.openapi_requests`:
types, required fields, enums and numeric ranges as the parsers and
:class:`~pipeline.contracts.request.GenerationConfig` check them, unknown fields refused
(``additionalProperties: false``), ``null`` allowed wherever a parser reads it as absent) and
the responses: 200 (JSON, or ``text/event-stream`` when ``stream`` is true) and each error
status in the dialect's body shape from :mod:`~transports.http.server.errors`.

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

from pipeline.contracts.request import Recording
from transports.http.dialects.openapi_requests import request_schemas
from transports.http.dialects.spec import (
    COUNT, OBJECT, STRING, Schema, array, integer, nullable, ref, response_object as out,
)
from transports.http.dialects.responses_output import KEEP_RESPONSES

JSON = "application/json"
SSE = "text/event-stream"
JSONL = "application/x-ndjson"
# The component names of the two error shapes.
OPENAI, ANTHROPIC = "OpenAIError", "AnthropicError"


# --- responses -------------------------------------------------------------------------------


def _json_text(schema: Schema) -> Schema:
    """A string holding JSON that ``schema`` describes (an SSE event's ``data``)."""
    return {"type": "string", "contentMediaType": JSON, "contentSchema": schema}


def _stream_event(event: Schema, data: Schema) -> Schema:
    """One SSE event as OpenAPI before 3.2 describes a ``text/event-stream`` item: its
    ``event`` name (``message`` when the stream sends none) and its ``data`` text."""
    return {"type": "object", "required": ["event", "data"],
            "properties": {"event": event, "data": data}}


FINISH: Schema = {"type": "string", "enum": ["stop", "length", "tool_calls", "cancelled",
                                              "error"]}
HEAD: Schema = {"id": STRING, "created": COUNT, "model": STRING}


def _usage() -> Schema:
    return out({"prompt_tokens": COUNT, "completion_tokens": COUNT, "total_tokens": COUNT,
                "prompt_tokens_details": out({"cached_tokens": COUNT})})


def _openai_responses() -> dict[str, Schema]:
    """``chat.completion``, and the ``chat.completion.chunk`` events of a stream."""
    token = out({"token": STRING, "bytes": array(integer(0, 255)),
                 "logprob": {"type": "number"}})
    logprobs = out({"content": array({**token, "properties": {
        **token["properties"], "top_logprobs": array(token)}})})
    function = out({"name": STRING, "arguments": STRING})
    call = out({"id": STRING, "type": {"const": "function"}, "function": function})
    message = out({"role": {"const": "assistant"}, "content": {"type": ["string", "null"]}},
                  {"reasoning_content": STRING, "tool_calls": array(call)})
    choice = out({"index": COUNT, "message": message, "logprobs": nullable(logprobs),
                  "finish_reason": FINISH})
    # a streamed call: id, type and name first, then the arguments, each part optional
    delta_call = out({"index": COUNT}, {"id": STRING, "type": {"const": "function"},
                                        "function": {"type": "object", "properties":
                                                     function["properties"]}})
    delta = out({}, {"role": {"const": "assistant"}, "content": STRING,
                     "reasoning_content": STRING, "tool_calls": array(delta_call)})
    chunk_choice = out({"index": COUNT, "delta": delta, "logprobs": nullable(logprobs),
                        "finish_reason": nullable(FINISH)})
    return {
        "ChatCompletion": out({**HEAD, "object": {"const": "chat.completion"},
                               "choices": array(choice, minItems=1), "usage": _usage()}),
        # the usage chunk (stream_options.include_usage) has no choices
        "ChatCompletionChunk": out({**HEAD, "object": {"const": "chat.completion.chunk"},
                                    "choices": array(chunk_choice, maxItems=1)},
                                   {"usage": nullable(_usage())}),
        "ChatStreamEvent": _stream_event({"const": "message"}, {"anyOf": [
            {"const": "[DONE]"},
            _json_text({"anyOf": [ref("ChatCompletionChunk"), ref(OPENAI)]})]}),
    }


def _completion_responses() -> dict[str, Schema]:
    """``text_completion``, whole and as the chunks of a stream."""
    logprobs = out({"tokens": array(STRING), "token_logprobs": array({"type": "number"}),
                    "top_logprobs": array({"type": "object",
                                           "additionalProperties": {"type": "number"}}),
                    "text_offset": array(COUNT)})
    choice = out({"text": STRING, "index": COUNT, "logprobs": nullable(logprobs),
                  "finish_reason": FINISH})
    chunk_choice = out({**choice["properties"], "finish_reason": nullable(FINISH)})
    return {
        "TextCompletion": out({**HEAD, "object": {"const": "text_completion"},
                               "choices": array(choice, minItems=1), "usage": _usage()}),
        "TextCompletionChunk": out({**HEAD, "object": {"const": "text_completion"},
                                    "choices": array(chunk_choice, maxItems=1)},
                                   {"usage": nullable(_usage())}),
        "TextStreamEvent": _stream_event({"const": "message"}, {"anyOf": [
            {"const": "[DONE]"},
            _json_text({"anyOf": [ref("TextCompletionChunk"), ref(OPENAI)]})]}),
    }


def _responses_api() -> dict[str, Schema]:
    """The Responses API's ``response``, its items and its stream's events (each ``event:``
    named by its ``type``); the embeddings list."""
    status = {"type": "string", "enum": ["in_progress", "completed", "incomplete"]}
    text = out({"type": {"const": "output_text"}, "text": STRING,
                "annotations": {"type": "array"}})
    thought = out({"type": {"const": "reasoning_text"}, "text": STRING})
    usage = out({"input_tokens": COUNT, "output_tokens": COUNT, "total_tokens": COUNT,
                 "input_tokens_details": out({"cached_tokens": COUNT})})

    def event(kind: str, **fields: Schema) -> Schema:
        return out({"type": {"const": kind}, "sequence_number": COUNT, **fields})

    at: dict[str, Schema] = {"item_id": STRING, "output_index": COUNT}
    part_at: dict[str, Schema] = {**at, "content_index": COUNT}
    lifecycle = [event(f"response.{k}", response=ref("Response"))
                 for k in ("created", "in_progress", "completed", "incomplete")]
    events = [*lifecycle,
              *(event(f"response.output_item.{k}", output_index=COUNT, item=ref("ResponseItem"))
                for k in ("added", "done")),
              *(event(f"response.content_part.{k}", **part_at, part={"oneOf": [text, thought]})
                for k in ("added", "done")),
              *(event(f"response.{k}.delta", **part_at, delta=STRING)
                for k in ("output_text", "reasoning_text")),
              *(event(f"response.{k}.done", **part_at, text=STRING)
                for k in ("output_text", "reasoning_text")),
              event("response.function_call_arguments.delta", **at, delta=STRING),
              event("response.function_call_arguments.done", **at, name=STRING,
                    arguments=STRING),
              event("error", message=STRING, code={"type": ["string", "null"]},
                    param={"type": ["string", "null"]})]
    names = [e["properties"]["type"]["const"] for e in events]
    vector = {"anyOf": [array({"type": "number"}), {**STRING, "description": "base64 of "
                                                              "little-endian float32"}]}
    return {
        "ResponseItem": {"oneOf": [
            out({"id": STRING, "type": {"const": "message"}, "role": {"const": "assistant"},
                 "status": status, "content": array(text)}),
            out({"id": STRING, "type": {"const": "reasoning"}, "status": status,
                 "summary": {"type": "array"}, "content": array(thought)}),
            out({"id": STRING, "type": {"const": "function_call"}, "status": status,
                 "call_id": STRING, "name": STRING, "arguments": STRING})]},
        "ResponseDeleted": out({"id": STRING, "object": {"const": "response"},
                                "deleted": {"const": True}}),
        "Response": out({
            "id": STRING, "object": {"const": "response"}, "created_at": COUNT,
            "status": status, "model": STRING, "output": array(ref("ResponseItem")),
            "incomplete_details": nullable(out({"reason": {"const": "max_output_tokens"}})),
            "usage": nullable(usage)}),
        "ResponseStreamEvent": _stream_event({"type": "string", "enum": names},
                                             _json_text({"oneOf": events})),
        "EmbeddingList": out({
            "object": {"const": "list"}, "model": STRING,
            "data": array(out({"object": {"const": "embedding"}, "index": COUNT,
                               "embedding": vector})),
            "usage": out({"prompt_tokens": COUNT, "total_tokens": COUNT})}),
    }


STOP_REASON: Schema = {"type": "string", "enum": [
    "end_turn", "max_tokens", "stop_sequence", "tool_use", "refusal"]}


def _anthropic_events() -> list[Schema]:
    """The ``data`` of each Messages stream event, by its ``type`` (which is the event name)."""

    def event(kind: str, **fields: Schema) -> Schema:
        return out({"type": {"const": kind}, **fields})

    start = out({"id": STRING, "type": {"const": "message"}, "role": {"const": "assistant"},
                  "content": {"type": "array", "maxItems": 0}, "model": STRING,
                  "stop_reason": {"type": "null"}, "stop_sequence": {"type": "null"},
                  "usage": out({"input_tokens": COUNT, "output_tokens": COUNT})})
    delta = {"oneOf": [event("text_delta", text=STRING),
                       event("thinking_delta", thinking=STRING),
                       event("input_json_delta", partial_json=STRING)]}
    stop = out({"stop_reason": STOP_REASON, "stop_sequence": {"type": ["string", "null"]}})
    return [
        event("message_start", message=start),
        event("content_block_start", index=COUNT, content_block=ref("AnthropicResponseBlock")),
        event("content_block_delta", index=COUNT, delta=delta),
        event("content_block_stop", index=COUNT),
        event("message_delta", delta=stop, usage=_anthropic_usage()),
        event("message_stop"), event("ping"), ref(ANTHROPIC),
    ]


def _anthropic_usage() -> Schema:
    """A finished message's usage: ``input_tokens`` are the prompt tokens not read from the
    cache (the prompt is the sum of the three input counts)."""
    return out({"input_tokens": COUNT, "cache_creation_input_tokens": COUNT,
                "cache_read_input_tokens": COUNT, "output_tokens": COUNT})


def _anthropic_responses() -> dict[str, Schema]:
    """The Messages answer, its stream's events, and the token count."""
    names = ["message_start", "content_block_start", "content_block_delta",
             "content_block_stop", "message_delta", "message_stop", "ping", "error"]
    usage = _anthropic_usage()
    return {
        "AnthropicResponseBlock": {"oneOf": [
            out({"type": {"const": "text"}, "text": STRING}),
            out({"type": {"const": "thinking"}, "thinking": STRING, "signature": STRING}),
            out({"type": {"const": "tool_use"}, "id": STRING, "name": STRING,
                  "input": OBJECT})]},
        "Message": out({
            "id": STRING, "type": {"const": "message"}, "role": {"const": "assistant"},
            "model": STRING, "content": array(ref("AnthropicResponseBlock")),
            "stop_reason": STOP_REASON, "stop_sequence": {"type": ["string", "null"]},
            "usage": usage}),
        "MessageStreamEvent": _stream_event({"type": "string", "enum": names},
                                            _json_text({"oneOf": _anthropic_events()})),
        "InputTokens": out({"input_tokens": COUNT}),
    }


def _other_responses() -> dict[str, Schema]:
    state = {"type": "string", "enum": ["loading", "ready", "failed", "restarting"]}
    model = out({"id": STRING, "object": {"const": "model"}, "created": COUNT,
                  "owned_by": STRING, "state": state},
                {"display_name": nullable(STRING), "description": nullable(STRING)})
    return {
        "ModelObject": model,
        "Tokens": out({"tokens": array(COUNT), "count": COUNT, "max_model_len": COUNT}),
        "Text": out({"prompt": STRING}),
        "ModelList": out({"object": {"const": "list"}, "data": array(model)}),
        "Health": out({"status": {"type": "string",
                                   "enum": ["ok", "loading", "failed", "engine_stopped",
                                            "degraded"]},
                        "models": {"type": "object", "additionalProperties": state}},
                       {"reasons": {"type": "object", "additionalProperties": {
                           "enum": ["stalled", "unresponsive", "engine_stopped", "rank_lost",
                                    "load_failed", "usage_store_down"]}},
                        "engine_failures": {"type": "object",
                                            "additionalProperties": STRING},
                        "model_failures": {"type": "object", "additionalProperties": STRING},
                        "problems": {"type": "object", "additionalProperties": STRING},
                        "restarts": {"type": "object", "additionalProperties": COUNT}}),
    }


def _error_schemas() -> dict[str, Schema]:
    """The two error shapes of ``errors.error_body``; extras (``served_models``,
    ``prompt_tokens``, ``limit``, ``requested``) ride alongside."""
    return {
        "OpenAIError": out({"error": out({
            "message": STRING, "type": STRING, "param": {"type": ["string", "null"]},
            "code": {"type": ["string", "null"]}})}),
        "AnthropicError": out({"type": {"const": "error"}, "error": out(
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
         "of that request, or no stored response of that id, is kept for this key",
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
    return {str(s): _json(ref(shape), _STATUS_TEXT[s]) for s in statuses}


def _body(schema: str) -> Schema:
    return {"required": True, "content": {JSON: {"schema": ref(schema)}}}


TRACEPARENT: Schema = {
    "name": "traceparent", "in": "header", "required": False,
    "description": "W3C trace context, carried into the request's metadata; non-zero trace "
                   "and parent ids, version not ff (a 400 otherwise)",
    "schema": {"type": "string", "pattern": (
        "^(?!ff)[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}$")}}


RECORDING: Schema = {
    "name": "x-pipeline-recording", "in": "header", "required": False,
    "description": "the request's trace level: `digest` (the default), `full` (also the "
                   "text, the ids and each step's raw and processed logits' top-k, which "
                   "`GET /traces/{request_id}/inspect` shows) or `taps` (`full` and each "
                   "layer's hidden state per step, as a digest and statistics, on a backend "
                   "with layer taps); anything else is a 400",
    "schema": {"type": "string", "enum": [r.value for r in Recording]}}
ID_PATTERN = "^[A-Za-z0-9_.-]{1,128}$"


def _trace_view(summary: str, description: str, names: Sequence[str]) -> Schema:
    """A GET over kept traces, each named by a request (or choice) id in the path."""
    return {"get": {
        "summary": summary, "description": description,
        "parameters": [{"name": n, "in": "path", "required": True,
                        "schema": {"type": "string", "pattern": ID_PATTERN}} for n in names],
        "responses": {"200": _json({"type": "object"}, "the view, as JSON"),
                      **_errors(OPENAI, (400, *LISTING, 404))}}}


def _generation(summary: str, body: str, answer: str, event: str, shape: str,
                overloaded: int) -> Schema:
    # Before OpenAPI 3.2 (itemSchema), an event stream's `schema` describes each event.
    ok = {"description": "the answer; an SSE event stream when `stream` is true",
          "headers": {"x-request-id": {
              "description": "the request's id, the body's `id`: `GET /traces/{request_id}` "
                             "returns its trace (every choice's when it asked for several; "
                             "choice k's alone at `GET /traces/{request_id}-{k}`)",
              "schema": STRING}},
          "content": {JSON: {"schema": ref(answer)}, SSE: {"schema": ref(event)}}}
    return {"post": {
        "summary": summary, "parameters": [TRACEPARENT, RECORDING], "requestBody": _body(body),
        "responses": {"200": ok, **_errors(shape, (*GENERATION, overloaded))}}}


def _post(summary: str, body: str, answer: str, shape: str) -> Schema:
    return {"post": {"summary": summary, "requestBody": _body(body), "responses": {
        "200": _json(ref(answer), "the answer"), **_errors(shape, GENERATION)}}}


def _open_get(summary: str, responses: Schema) -> Schema:
    """A GET that needs no key."""
    return {"get": {"summary": summary, "security": [], "responses": responses}}


def _stored_response() -> Schema:
    """``GET`` and ``DELETE /v1/responses/{response_id}``."""
    path = [{"name": "response_id", "in": "path", "required": True, "schema": STRING,
             "description": "a `POST /v1/responses` answer's `id` (stored unless it asked "
                            "`store: false`)"}]
    kept = (f"The last {KEEP_RESPONSES} stored responses are kept, each readable and "
            "deletable only with an API key it was made with; for any other key, and for an "
            "unknown, deleted or dropped id, a 404.")
    return {
        "get": {"summary": "a stored response object, as `POST /v1/responses` answered it",
                "description": kept + " It comes back whole: no query parameter but "
                                      "`stream=false` is taken (a 400 names any other).",
                "parameters": [*path, {"name": "stream", "in": "query", "required": False,
                                       "schema": {"type": "string", "enum": ["false"]}}],
                "responses": {"200": _json(ref("Response"), "the stored response"),
                              **_errors(OPENAI, (400, *LISTING, 404))}},
        "delete": {"summary": "forget a stored response (its object and its conversation for "
                              "`previous_response_id`)", "description": kept,
                   "parameters": path,
                   "responses": {"200": _json(ref("ResponseDeleted"), "it is deleted"),
                                 **_errors(OPENAI, (*LISTING, 404))}}}


def _paths() -> Schema:
    text = {"description": "Prometheus text exposition",
            "content": {"text/plain": {"schema": STRING}}}
    return {
        "/v1/chat/completions": _generation("OpenAI chat completions", "ChatCompletionRequest",
                                            "ChatCompletion", "ChatStreamEvent", OPENAI, 429),
        "/v1/completions": _generation("OpenAI (legacy) text completions: raw prompts, no chat "
                                       "template", "CompletionRequest", "TextCompletion",
                                       "TextStreamEvent", OPENAI, 429),
        "/v1/responses": _generation("OpenAI Responses: the chat flow, answered as a "
                                     "`response` (kept for `previous_response_id`)",
                                     "ResponsesRequest", "Response", "ResponseStreamEvent",
                                     OPENAI, 429),
        "/v1/responses/{response_id}": _stored_response(),
        "/v1/embeddings": _post("OpenAI embeddings: each input's final hidden states, "
                                "mean-pooled and L2-normalized", "EmbeddingsRequest",
                                "EmbeddingList", OPENAI),
        "/v1/messages": _generation("Anthropic Messages", "MessagesRequest", "Message",
                                    "MessageStreamEvent", ANTHROPIC, 529),
        "/v1/messages/count_tokens": _post("the prompt's exact token count",
                                           "CountTokensRequest", "InputTokens", ANTHROPIC),
        "/tokenize": _post("text or chat messages to token ids", "TokenizeRequest", "Tokens",
                           OPENAI),
        "/detokenize": _post("token ids to text", "DetokenizeRequest", "Text", OPENAI),
        "/v1/models": {"get": {"summary": "the served models and their state", "responses": {
            "200": _json(ref("ModelList"), "the served models"), **_errors(OPENAI, LISTING)}}},
        "/v1/models/{model}": {"get": {
            "summary": "one served model", "parameters": [{
                "name": "model", "in": "path", "required": True, "schema": STRING}],
            "responses": {"200": _json(ref("ModelObject"), "the model"),
                          **_errors(OPENAI, (*LISTING, 404))}}},
        "/health": _open_get("readiness", {
            "200": _json(ref("Health"), "every model is loaded"),
            "503": _json(ref("Health"), "some model is loading or failed")}),
        "/health/details": {"get": {
            "summary": "readiness for the operator: why each worker is down, restart counts",
            "responses": {"200": _json(ref("Health"), "every model is loaded"),
                          "503": _json(ref("Health"), "some model is loading or failed"),
                          **_errors(OPENAI, LISTING)}}},
        "/metrics": _open_get("Prometheus metrics", {"200": text}),
        "/openapi.json": _open_get("this document", {
            "200": _json({"type": "object", "required": ["openapi", "info", "paths"]},
                         "the OpenAPI document")}),
        "/traces/{request_id}": {"get": {
            "summary": "a finished request's event trace, as JSONL (`pipeline trace` reads it)",
            "description": "The traces of the last `keep_traces` finished requests are kept, "
                           "each readable only with an API key the request was made with; "
                           "for any other key, and for an unknown or evicted id, a 404. The "
                           "id is a generation response's `id` and `x-request-id` header. "
                           "A request of several choices (`n`, or a batch of completions "
                           "prompts) answers with every choice's trace, one after the other "
                           "in choice order, each under its own trace id `{request_id}-{k}`, "
                           "which also reads choice k's trace alone.",
            "parameters": [{"name": "request_id", "in": "path", "required": True,
                            "schema": STRING}],
            "responses": {"200": {"description": "one JSON event per line",
                                  "content": {JSONL: {"schema": STRING}}},
                          **_errors(OPENAI, (*LISTING, 404))}}},
        "/traces/{request_id}/inspect": _trace_view(
            "one kept trace as the chat page's inspector shows it",
            "Each step's token with its raw and processed top-k (a trace recorded at `full`) "
            "and the processors applied, and the timeline (phases, latencies, ending). The "
            "same keys read it as `GET /traces/{request_id}`; a request of several choices "
            "is named by a choice's id (a 400 otherwise).", ["request_id"]),
        "/traces/{a}/diff/{b}": _trace_view(
            "the first divergence between two kept traces (`pipeline trace diff`)",
            "The diff report's JSON (first divergent product, its level and step, the shared "
            "reproducibility level, the declared differences), `first_token_step` (the first "
            "step whose tokens differ) and the report as `text`. Both traces must be readable "
            "with the caller's key (a 404 otherwise).", ["a", "b"]),
        "/web/{name}": _open_get("one of the chat page's scripts (vendored or its own)", {
            "200": {"description": "JavaScript",
                    "content": {"text/javascript": {"schema": STRING}}},
            **_errors(OPENAI, (404,))}),
        "/": _open_get("the web chat page", {
            "200": {"description": "a self-contained HTML page",
                    "content": {"text/html": {"schema": STRING}}}}),
    }


def _schemas(served_models: Sequence[str], max_n: int) -> Schema:
    model = {"type": "string", "enum": list(served_models),
             "description": "a served model's name; any other name is answered 404 "
                            "(`model_not_found`, with `served_models`)"}
    return {
        "Model": model, **request_schemas(max_n), **_openai_responses(),
        **_completion_responses(), **_responses_api(), **_anthropic_responses(),
        **_other_responses(),
        **_error_schemas(),
    }


def openapi_document(served_models: Sequence[str], max_n: int = 16) -> dict[str, Any]:
    """The OpenAPI 3.1 document of a server serving ``served_models`` (their names) with the
    ``max_n`` limit on choices."""
    return {
        "openapi": "3.1.0",
        "info": {"title": "pipeline", "version": "1",
                 "description": "OpenAI and Anthropic dialects over one inspectable pipeline. "
                                "A null optional field is the same as an absent one. An "
                                "integer field takes a JSON integer: 1.0 or 1e3 is a 400."},
        # Either header carries the key; /health, /metrics, / and this document need none.
        "security": [{"bearer": []}, {"apiKey": []}],
        "paths": _paths(),
        "components": {
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}},
            "schemas": _schemas(served_models, max_n)},
    }
