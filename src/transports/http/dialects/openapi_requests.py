"""The request bodies of the server's OpenAPI document.

Owns :func:`request_schemas` (every request body :mod:`~transports.http.dialects.openapi`
refers to, as the dialect parsers check them: the plain fields from the tables of
:mod:`~transports.http.dialects.spec` the parsers read them with, the structured ones
(messages, parts, tools) as :mod:`~transports.http.dialects.openai`,
:mod:`~transports.http.dialects.completions`, :mod:`~transports.http.dialects.anthropic` and
:mod:`~transports.http.dialects.documented` read them). A request object refuses unknown keys (``additionalProperties: false``) and
takes ``null`` wherever a parser reads it as absent; a documented field this server refuses
(:mod:`~transports.http.dialects.documented`) is in the document with only the values it accepts
(usually ``null``) and a description saying why.
"""

from __future__ import annotations

from transports.http.dialects.spec import (
    ANTHROPIC_REFUSED, ANTHROPIC_SAMPLING, BOOLEAN, CHAT_REFUSED, CHAT_SAMPLING, COUNT, EFFORT,
    OBJECT, OPENAI_IGNORED, RESPONSES_SAMPLING, SAMPLING, STOP, STOP_STRINGS, STRING, TOOL_NAME,
    Schema, Spec, array, enum, integer, ref, refused, request_object, schemas,
)


# --- the OpenAI dialect's requests -----------------------------------------------------------


def _openai_parts() -> dict[str, Schema]:
    """Message content, tool calls and tools of ``POST /v1/chat/completions``."""
    return {
        "OpenAITextPart": request_object({"type": {"const": "text"}, "text": STRING},
                                         {"cache_control": OBJECT}),
        "OpenAIFilePart": request_object(
            {"type": {"const": "file"}, "file": request_object(
                {"file_data": STRING}, {"filename": STRING})},
            description="a user's document (PDF, DOCX, XLSX, CSV, text), base64 or a data URL, "
                        "read to text; `file_id` is refused (no file store)"),
        "OpenAIContent": {"oneOf": [STRING, array({"oneOf": [ref("OpenAITextPart"),
                                                              ref("OpenAIFilePart")]})],
                          "description": "a string, or text parts (and, from the user, file "
                                         "parts) joined in order"},
        "OpenAIToolCall": request_object(
            {"function": request_object({"name": STRING}, {"arguments": STRING})},
            {"type": {"const": "function"}, "id": STRING}),
        "OpenAITool": request_object({"type": {"const": "function"}, "function": request_object(
            {"name": TOOL_NAME},
            {"description": STRING, "parameters": OBJECT, "strict": BOOLEAN})}),
        "OpenAIToolChoice": {"oneOf": [
            enum("none", "auto", "required"),
            request_object({"type": {"const": "function"},
                            "function": request_object({"name": STRING})},
                           description="must name a tool in `tools`")],
            "description": "`required` needs at least one tool in `tools`"},
    }


def _openai_message() -> Schema:
    """One chat message: the role decides what else it needs (``_message`` in openai)."""
    no_calls = {"type": "array", "maxItems": 0, "description": "only assistant messages call tools"}
    shared = {"name": STRING, "reasoning_content": STRING}
    plain = request_object({"role": enum("system", "developer", "user"),
                            "content": ref("OpenAIContent")},
                           {**shared, "tool_call_id": STRING, "tool_calls": no_calls})
    tool = request_object({"role": {"const": "tool"}, "content": ref("OpenAIContent"),
                           "tool_call_id": STRING}, {**shared, "tool_calls": no_calls})
    assistant = request_object({"role": {"const": "assistant"}},
                               {**shared, "content": ref("OpenAIContent"),
                                "tool_call_id": STRING,
                                "tool_calls": array(ref("OpenAIToolCall"))},
                               description="needs `content` or at least one tool call")
    assistant["anyOf"] = [
        {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
        {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array",
                                                                   "minItems": 1}}}]
    return {"oneOf": [plain, tool, assistant]}


def _sampling_openai(table: dict[str, Spec] = SAMPLING) -> Schema:
    """The sampling fields both OpenAI endpoints take (``sampling`` in openai): ``table``'s
    numbers, ``seed``, ``logit_bias`` and ``stop``."""
    return {
        **schemas(table),
        "seed": {"type": "integer", "description": "any integer; taken modulo 2**63; choice i "
                                                   "of a prompt uses seed + i"},
        "logit_bias": {"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
                       "additionalProperties": {"type": "number", "minimum": -100,
                                                "maximum": 100},
                       "description": "token id (below the vocabulary size) -> bias"},
        "stop": STOP,
    }


def _openai_ignored() -> Schema:
    """Fields both OpenAI endpoints' APIs document that change nothing here
    (``openai_ignored`` in documented)."""
    return {
        **schemas(OPENAI_IGNORED),
        "metadata": {"type": "object", "maxProperties": 16, "additionalProperties": STRING},
        "prompt_cache_options": request_object({}, {"mode": enum("implicit", "explicit"),
                                                    "ttl": enum("30m")}),
    }


def _stream_options() -> Schema:
    return request_object({}, {"include_usage": BOOLEAN, "include_obfuscation": BOOLEAN},
                          description="only with `stream: true`")


def _chat_request(max_n: int) -> Schema:
    limits = integer(1, description="clamped to the room left in the window unless the server "
                                    "runs with --no-clamp; the server default when absent")
    prediction = request_object({"type": {"const": "content"}, "content": {"oneOf": [
        STRING, array(request_object({"type": {"const": "text"}, "text": STRING}))]}})
    return request_object(
        {"model": ref("Model"), "messages": array(ref("OpenAIMessage"), minItems=1)},
        {**_sampling_openai(CHAT_SAMPLING), **_openai_ignored(),
         "logprobs": BOOLEAN, "max_tokens": limits, "max_completion_tokens": limits,
         "n": integer(1, max_n, "choices, generated together (the server's --max-n)"),
         "tools": array(ref("OpenAITool")), "tool_choice": ref("OpenAIToolChoice"),
         "parallel_tool_calls": BOOLEAN, "stream": BOOLEAN, "stream_options": _stream_options(),
         "user": STRING,
         "reasoning_effort": enum("none", "minimal", "low", "medium", "high", "xhigh", "max",
                                  description="`none` turns the template's enable_thinking "
                                              "off, any other value on"),
         "verbosity": enum("low", "medium", "high", description="accepted, ignored"),
         "prediction": {**prediction, "description": "accepted, ignored (a latency hint)"},
         "response_format": {"oneOf": [
             request_object({"type": {"const": "text"}}),
             request_object({"type": {"const": "json_object"}}),
             request_object({"type": {"const": "json_schema"}, "json_schema": request_object(
                 {"name": STRING}, {"description": STRING, "schema": OBJECT,
                                    "strict": BOOLEAN})})],
             "description": "json_object / json_schema: the output is one JSON object (valid "
                            "for the schema) by construction, strict or not; a schema feature "
                            "the grammar engine lacks is a 400"},
         **_constraints(),
         "modalities": {**array({"const": "text"}), "description": "only text comes out"},
         **schemas(CHAT_REFUSED)})


def _completions_request(max_n: int) -> Schema:
    ids = array({**COUNT, "description": "below the model's vocabulary size"}, minItems=1)
    prompt = {"oneOf": [STRING, ids, array({"oneOf": [STRING, ids]}, minItems=1,
                                           maxItems=max_n)],
              "description": "text (tokenized as the tokenizer alone does: its BOS rule, "
                             "special-token strings parsed; no chat template), token ids, or "
                             "a list of either (n choices each; n times the prompts at most "
                             "the server's --max-n)"}
    return request_object(
        {"model": ref("Model"), "prompt": prompt},
        {**_sampling_openai(),
         "max_tokens": integer(1, description="16 when absent; clamped to the room left in "
                                              "the window unless the server runs with "
                                              "--no-clamp"),
         "logprobs": integer(0, 20, "top alternatives per token (legacy form); not with "
                                    "`echo`"),
         "echo": BOOLEAN, "n": integer(1, max_n, "choices per prompt, generated together"),
         "best_of": integer(1, max_n, "must equal n (no server-side ranking)"),
         "suffix": {"const": "", "description": "not supported here: no fill-in-the-middle "
                                                "(a 400 unless empty)"},
         "stream": BOOLEAN, "stream_options": _stream_options(), "user": STRING,
         **_constraints()})


def _constraints() -> dict[str, Schema]:
    """vLLM's output-constraint fields (one constraint per request, ``response_format``
    counted)."""
    text = {"type": "string", "minLength": 1, "maxLength": 4096}
    choice = array({"type": "string", "minLength": 1, "maxLength": 256}, minItems=1,
                   maxItems=64)
    why = ("the output follows it by construction; one constraint per request "
           "(response_format counted); one that does not compile is a 400")
    return {
        "structured_outputs": {**request_object({}, {
            "json": OBJECT, "regex": text, "choice": choice, "grammar": text,
            "json_object": {"const": True}, "disable_fallback": BOOLEAN,
            "disable_any_whitespace": BOOLEAN, "disable_additional_properties": BOOLEAN,
            "whitespace_pattern": STRING}), "description": "give at most one of json, regex, "
                                                            "choice, grammar (Lark or EBNF) "
                                                            "and json_object: " + why},
        "guided_json": {**OBJECT, "description": "a JSON schema (older form): " + why},
        "guided_regex": {**text, "description": "a regular expression (older form): " + why},
        "guided_choice": {**choice, "description": "strings (older form): " + why},
        "guided_grammar": {**text, "description": "Lark or EBNF text (older form): " + why},
        "guided_decoding_backend": {**STRING, "description": "accepted, ignored"},
        "guided_whitespace_pattern": {**STRING, "description": "accepted, ignored"}}


# --- OpenAI's Responses API and embeddings ----------------------------------------------------


def _responses_items() -> dict[str, Schema]:
    """The input items of ``POST /v1/responses`` (``_input`` in responses)."""
    status = enum("in_progress", "completed", "incomplete")
    text = request_object({"type": enum("input_text", "output_text"), "text": STRING},
                          {"annotations": {"type": "array"}, "logprobs": {"type": "array"}})
    refusal = request_object({"type": {"const": "refusal"}, "refusal": STRING},
                             description="in an assistant message only")
    file = request_object({"type": {"const": "input_file"}, "file_data": STRING},
                          {"filename": STRING},
                          description="a user's document (PDF, DOCX, XLSX, CSV, text), base64 "
                                      "or a data URL, read to text; file_id and file_url are "
                                      "refused")
    content = {"anyOf": [STRING, array({"anyOf": [text, refusal, file]})]}
    return {
        "ResponsesInputItem": {"anyOf": [
            request_object({"role": enum("user", "system", "developer", "assistant"),
                            "content": content},
                           {"type": {"const": "message"}, "id": STRING, "status": status,
                            "phase": enum("commentary", "final_answer")}),
            request_object({"type": {"const": "function_call"}, "call_id": STRING,
                            "name": STRING, "arguments": STRING},
                           {"id": STRING, "status": status, "namespace": STRING},
                           description="joins the assistant turn before it"),
            request_object({"type": {"const": "function_call_output"}, "call_id": STRING,
                            "output": {"anyOf": [STRING, array(text)]}},
                           {"id": STRING, "status": status}),
            request_object({"type": {"const": "reasoning"}},
                           {"id": STRING, "summary": {"type": "array"},
                            "content": {"type": "array"}, "encrypted_content": STRING,
                            "status": status}, description="accepted, dropped")],
            "description": "a message needs at least one of them in `input`"},
    }


def _responses_request() -> Schema:
    tool = request_object({"type": {"const": "function"}, "name": TOOL_NAME},
                          {"description": STRING, "parameters": OBJECT,
                           "strict": {**BOOLEAN, "description": "true when absent"},
                           "defer_loading": BOOLEAN})
    choice = {"anyOf": [enum("none", "auto", "required"),
                        request_object({"type": {"const": "function"}, "name": STRING},
                                       description="must name a tool in `tools`")]}
    fmt = {"anyOf": [
        request_object({"type": enum("text", "json_object")}),
        request_object({"type": {"const": "json_schema"}, "name": STRING, "schema": OBJECT},
                       {"description": STRING, "strict": BOOLEAN})],
        "description": "json_object / json_schema: the output is one JSON object (valid for "
                       "the schema) by construction; a schema feature the grammar engine "
                       "lacks is a 400"}
    return request_object(
        {"model": ref("Model"),
         "input": {"anyOf": [STRING, array(ref("ResponsesInputItem"), minItems=1)]}},
        {**_sampling_openai(RESPONSES_SAMPLING), **_openai_ignored(),
         "instructions": {**STRING, "description": "a system message first (not kept for "
                                                   "`previous_response_id`)"},
         "previous_response_id": {**STRING, "description": "a response kept here, made with "
                                                           "this key (a 400 otherwise)"},
         "max_output_tokens": integer(1, description="clamped to the room left in the window "
                                                     "unless the server runs with --no-clamp"),
         "tools": array(tool), "tool_choice": choice, "parallel_tool_calls": BOOLEAN,
         "text": request_object({}, {"format": fmt, "verbosity": enum("low", "medium",
                                                                      "high")}),
         "reasoning": request_object({}, {
             "effort": enum("none", "minimal", "low", "medium", "high", "xhigh",
                            description="`none` turns the template's enable_thinking off"),
             "summary": enum("auto", "concise", "detailed"),
             "generate_summary": enum("auto", "concise", "detailed")}),
         "stream": BOOLEAN, "stream_options": request_object({}, {"include_obfuscation":
                                                                  BOOLEAN}),
         "user": STRING,
         "background": {"const": False, "description": "not supported here when true"},
         "include": {"type": "array", "maxItems": 0,
                     "description": "not supported here: no extra output data"},
         "truncation": enum("disabled", description="`auto` is not supported here"),
         "top_logprobs": integer(0, 0, "not supported here above 0"),
         "conversation": refused("no server-held conversations"),
         "prompt": refused("no stored prompt templates"),
         "max_tool_calls": refused("no server-side tools"),
         "context_management": refused("no server-side context editing")})


def _embeddings_request() -> Schema:
    ids = array({**COUNT, "description": "below the model's vocabulary size"}, minItems=1)
    return request_object(
        {"model": ref("Model"),
         "input": {"anyOf": [STRING, ids, array({"anyOf": [STRING, ids]}, minItems=1,
                                                 maxItems=2048)],
                   "description": "text (tokenized as /v1/completions tokenizes a prompt), "
                                  "token ids, or a list of either; each within the window"}},
        {"encoding_format": enum("float", "base64"),
         "dimensions": integer(1, description="only the model's own size"),
         "user": STRING})


# --- the Anthropic dialect's requests --------------------------------------------------------


def _cache_control() -> Schema:
    return request_object({"type": {"const": "ephemeral"}}, {"ttl": enum("5m", "1h")})


def _anthropic_blocks() -> dict[str, Schema]:
    """Content blocks of ``POST /v1/messages`` by role (``_blocks`` in anthropic)."""
    cache = {"cache_control": OBJECT}
    text_part = request_object({"type": {"const": "text"}, "text": STRING}, cache)
    return {
        "AnthropicTextPart": text_part,
        "AnthropicTextBlock": request_object({"type": {"const": "text"}, "text": STRING},
                                             {**cache, "citations": {"type": "array"}}),
        "AnthropicThinkingBlock": request_object(
            {"type": {"const": "thinking"}, "thinking": STRING},
            {**cache, "signature": STRING}),
        "AnthropicToolUseBlock": request_object(
            {"type": {"const": "tool_use"}, "id": STRING, "name": STRING, "input": OBJECT},
            {**cache, "caller": OBJECT}),
        "AnthropicToolResultBlock": request_object(
            {"type": {"const": "tool_result"}, "tool_use_id": STRING},
            {**cache, "is_error": BOOLEAN,
             "content": {"oneOf": [STRING, array(ref("AnthropicTextPart"))]}}),
        "AnthropicDocumentBlock": request_object(
            {"type": {"const": "document"}, "source": {"oneOf": [
                request_object({"type": {"const": "base64"}, "media_type": enum(
                    "application/pdf",
                    "application/vnd.openxmlformats-officedocument.wordprocessingml.document",
                    "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet",
                    "text/csv", "text/plain", "text/markdown"), "data": STRING}),
                request_object({"type": {"const": "text"}, "data": STRING},
                               {"media_type": {"const": "text/plain"}})]}},
            {**cache, "title": STRING, "context": STRING, "citations": OBJECT},
            description="read to text (a PDF needs a text layer: no OCR); cut head 70 % and "
                        "tail 30 % when the window is short"),
        "AnthropicUserMessage": request_object({"role": {"const": "user"}, "content": {
            "oneOf": [STRING, array({"oneOf": [ref("AnthropicTextBlock"),
                                               ref("AnthropicToolResultBlock"),
                                               ref("AnthropicDocumentBlock")]})]}}),
        "AnthropicAssistantMessage": request_object({"role": {"const": "assistant"}, "content": {
            "oneOf": [STRING, array({"oneOf": [
                ref("AnthropicTextBlock"), ref("AnthropicThinkingBlock"),
                ref("AnthropicToolUseBlock")]})]}}),
    }


def _anthropic_tools() -> dict[str, Schema]:
    display = {"display": enum("summarized", "omitted", description="accepted, ignored")}
    return {
        "AnthropicTool": request_object(
            {"name": TOOL_NAME, "input_schema": OBJECT},
            {"type": {"const": "custom", "description": "only custom tools: a server tool "
                                                        "is a 400"},
             "description": STRING, "cache_control": _cache_control(),
             "allowed_callers": array(STRING), "defer_loading": BOOLEAN,
             "eager_input_streaming": BOOLEAN, "input_examples": array(OBJECT),
             "strict": BOOLEAN}),
        "AnthropicToolChoice": {"oneOf": [
            request_object({"type": enum("auto", "any", "none")},
                           {"name": STRING, "disable_parallel_tool_use": BOOLEAN},
                           description="`any` needs at least one tool in `tools`"),
            request_object({"type": {"const": "tool"}, "name": STRING},
                           {"disable_parallel_tool_use": BOOLEAN},
                           description="must name a tool in `tools`")]},
        "AnthropicThinking": {"oneOf": [
            request_object({"type": {"const": "enabled"},
                            "budget_tokens": integer(0, description="the reasoning budget")},
                           display),
            request_object({"type": {"const": "disabled"}}),
            request_object({"type": enum("adaptive", "between_tools")}, display)]},
    }


def _count_fields() -> tuple[Schema, Schema]:
    """What ``/v1/messages`` and ``/v1/messages/count_tokens`` share: required, optional."""
    required = {"model": ref("Model"), "messages": array(
        {"oneOf": [ref("AnthropicUserMessage"), ref("AnthropicAssistantMessage")]},
        minItems=1)}
    beta = {**schemas(ANTHROPIC_REFUSED), "billing_policy": OBJECT,
            "fallbacks": {"oneOf": [{"type": "array"}, {"const": "default"}]},
            "fallback_credit_token": {"type": ["string", "object"]}}
    optional = {
        "system": {"oneOf": [STRING, array(ref("AnthropicTextPart"))]},
        "tools": array(ref("AnthropicTool")), "tool_choice": ref("AnthropicToolChoice"),
        **schemas(ANTHROPIC_SAMPLING),
        "seed": {"type": "integer", "description": "an extension; taken modulo 2**63"},
        "stop_sequences": STOP_STRINGS, "thinking": ref("AnthropicThinking"),
        "cache_control": _cache_control(),
        "output_config": request_object({}, {
            "effort": enum(*EFFORT, description="accepted, ignored"),
            "format": request_object(
                {"type": {"const": "json_schema"}, "schema": OBJECT},
                description="the text is JSON valid for the schema, by construction; a schema "
                            "feature the grammar engine lacks is a 400")}),
        "speed": enum("standard", "fast"), "user_profile_id": STRING, "workspace_id": STRING,
        "service_tier": enum("auto", "standard_only"), "inference_geo": STRING,
        "diagnostics": request_object({}, {"previous_message_id": STRING}),
        "container": {"oneOf": [STRING, request_object({}, {"id": STRING,
                                                            "skills": array(OBJECT)})]},
        **beta,
    }
    return required, optional


def _messages_request() -> Schema:
    required, optional = _count_fields()
    return request_object({**required, "max_tokens": integer(1, description=(
        "clamped to the room left in the window unless the server runs with --no-clamp"))},
        {**optional, "stream": BOOLEAN, "metadata": request_object({}, {"user_id": STRING})})


def _count_request() -> Schema:
    required, optional = _count_fields()
    return request_object(required, optional, description="a Messages body without "
                                                           "`max_tokens`, `stream` and "
                                                           "`metadata`")


# --- the token endpoints ---------------------------------------------------------------------


def _tokenize_request() -> Schema:
    chat = request_object({"model": ref("Model"), "messages": array(ref("OpenAIMessage"),
                                                                    minItems=1)},
                          {"add_generation_prompt": {**BOOLEAN, "default": True},
                           "tools": array(ref("OpenAITool")),
                           "tool_choice": ref("OpenAIToolChoice")},
                          description="messages through the chat template (with the tools "
                                      "it shows: the Hermes block for a template that "
                                      "renders none)")
    text = request_object({"model": ref("Model"), "prompt": STRING},
                          {"messages": {"type": "null"}}, description="plain text, no template")
    return {"oneOf": [chat, text]}


def _detokenize_request() -> Schema:
    token = {**COUNT, "description": "below the model's vocabulary size (a 400 otherwise)"}
    return request_object({"model": ref("Model"), "tokens": array(token)})


def request_schemas(max_n: int) -> dict[str, Schema]:
    """Every request body's component schema, for a server whose ``max_n`` limit is given."""
    return {
        **_openai_parts(), "OpenAIMessage": _openai_message(),
        "ChatCompletionRequest": _chat_request(max_n),
        "CompletionRequest": _completions_request(max_n),
        **_responses_items(), "ResponsesRequest": _responses_request(),
        "EmbeddingsRequest": _embeddings_request(),
        **_anthropic_blocks(), **_anthropic_tools(),
        "MessagesRequest": _messages_request(), "CountTokensRequest": _count_request(),
        "TokenizeRequest": _tokenize_request(), "DetokenizeRequest": _detokenize_request(),
    }
