"""Size limits on what one request may ask for, checked at the door before any real work.

Owns :class:`Limits`, the server's configurable bounds (``pipeline serve --max-...``), and
their check on a request body that is parsed JSON but not yet validated by a dialect, so a
hostile body is refused before it is rendered, tokenized or even read field by field:

==========================  ===========  ===================================================
setting                     default      what it bounds (error)
==========================  ===========  ===================================================
``max_body_bytes``          4 MiB        the request body (413, before it is all read)
``max_json_depth``          64           nesting of the JSON body (400)
``max_messages``            2048         ``messages`` entries, each content block and tool
                                         call in them counting as one more (400)
``max_stop``                16           stop strings: ``stop`` / ``stop_sequences`` (400;
                                         at most the library's own cap of 16)
``max_stop_chars``          1024         characters of each stop string (400)
``max_tools``               128          ``tools`` entries (400)
``max_tool_schema_bytes``   65536        each tool's definition, and the JSON schema of a
                                         ``response_format`` or ``output_config.format``,
                                         as compact JSON (400; each is compiled to a
                                         grammar when a call or format is required)
``max_logit_bias``          2048         ``logit_bias`` entries (400; each is work on every
                                         step of the request's batch)
``max_prompt_chars``        1,000,000    characters of all text (keys included) in
                                         ``messages``, ``system``, ``prompt`` and ``tools``,
                                         before tokenization (400)
``max_n``                   16           choices one request asks for: ``n``, times the
                                         prompts of a batched ``/v1/completions`` request
                                         (400; each choice is a generation of its own)
``max_header_bytes``        64 KiB       a request's head: its request line and header
                                         fields (431 and close, while they arrive)
``max_headers``             100          header fields of one request (431 and close)
==========================  ===========  ===================================================

The two head limits are enforced below the app, in uvicorn's protocols, while the head
arrives (:mod:`transports.http.server.wire`): the app never sees such a request. Every other refusal
is a :class:`~pipeline.errors.LimitExceededError` (or
:class:`~transports.http.serving_errors.PayloadTooLargeError`) naming the field, the value, the limit and the
setting. A prompt within ``max_prompt_chars`` can still be too long for the model's window:
the gateway refuses it, still before tokenizing, when its characters cannot fit even at the
longest token's length (:meth:`transports.http.gateway.fit.WindowFit.fit`).
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from pipeline.errors import InvalidValueError, LimitExceededError
from pipeline.contracts.request import MAX_STOP

MIB = 1 << 20


def _at_least_one(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidValueError(attribute.name, value, "must be an integer >= 1")


def _limit(default: int, help: str) -> Any:
    return attrs.field(default=default, validator=_at_least_one, metadata={"help": help})


@attrs.frozen
class Limits:
    """The server's bounds on one request (see the module docstring for each)."""

    def __attrs_post_init__(self) -> None:
        if self.max_stop > MAX_STOP:
            raise InvalidValueError("max_stop", self.max_stop,
                                    f"at most {MAX_STOP}, the library's own cap")

    max_body_bytes: int = _limit(4 * MIB, "request body size in bytes (413)")
    max_json_depth: int = _limit(64, "nesting depth of the JSON body")
    max_messages: int = _limit(2048, "messages in one request")
    max_stop: int = _limit(16, "stop strings in one request")
    max_stop_chars: int = _limit(1024, "characters in one stop string")
    max_tools: int = _limit(128, "tools in one request")
    max_tool_schema_bytes: int = _limit(64 * 1024, "bytes of one tool's compact JSON definition "
                                               "or of a response format's JSON schema (or "
                                               "other output constraint)")
    max_prompt_chars: int = _limit(1_000_000, "characters of prompt text, before tokenizing")
    max_logit_bias: int = _limit(2048, "logit_bias entries in one request")
    max_n: int = _limit(16, "choices in one request (n, times the prompts of a batched "
                            "completions request)")
    max_header_bytes: int = _limit(64 * 1024, "bytes of a request's request line and header "
                                              "fields (431)")
    max_headers: int = _limit(100, "header fields in one request (431)")

    def check(self, body: Any) -> None:
        """Raise for the first limit ``body`` (parsed JSON of any endpoint) exceeds. Fields
        of the wrong type are left for the dialect's parser to name."""
        if not isinstance(body, dict):
            return
        units = _message_units(body.get("messages"))
        if units > self.max_messages:
            raise LimitExceededError("messages", "max_messages", units, self.max_messages,
                                     "messages and content blocks")
        self._count(body, "tools", self.max_tools, "max_tools", "tools")
        self._count(body, "logit_bias", self.max_logit_bias, "max_logit_bias", "biased tokens")
        for name in ("stop", "stop_sequences"):
            self._stops(name, body.get(name))
        self._tools(body.get("tools"))
        self._formats(body)
        chars = sum(text_chars(body.get(name))
                    for name in ("messages", "system", "prompt", "tools"))
        if chars > self.max_prompt_chars:
            raise LimitExceededError("messages", "max_prompt_chars", chars,
                                     self.max_prompt_chars, "characters of prompt text")
        self._choices(body)

    def _choices(self, body: dict[str, Any]) -> None:
        """``n`` times the prompts (a list of texts or of id lists counts each prompt).
        Wrong types are left for the parser."""
        n, prompt = body.get("n"), body.get("prompt")
        n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
        prompts = 1
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list))
                                                       for p in prompt):
            prompts = len(prompt)  # a batch; a list of ids is one prompt
        if n * prompts > self.max_n:
            field = "n" if prompts == 1 else "prompt"
            raise LimitExceededError(field, "max_n", n * prompts, self.max_n,
                                     "choices (n, times the prompts)")

    @staticmethod
    def _count(body: dict[str, Any], name: str, maximum: int, setting: str, what: str) -> None:
        value = body.get(name)
        if isinstance(value, (list, dict)) and len(value) > maximum:
            raise LimitExceededError(name, setting, len(value), maximum, what)

    def _stops(self, name: str, value: Any) -> None:
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list):
            return
        if len(stops) > self.max_stop:
            raise LimitExceededError(name, "max_stop", len(stops), self.max_stop,
                                     "stop strings")
        for i, stop in enumerate(stops):
            if isinstance(stop, str) and len(stop) > self.max_stop_chars:
                raise LimitExceededError(f"{name}[{i}]" if stops is value else name,
                                         "max_stop_chars", len(stop), self.max_stop_chars,
                                         "characters in a stop string")

    def _tools(self, tools: Any) -> None:
        if not isinstance(tools, list):
            return
        for i, tool in enumerate(tools):
            size = _compact_size(tool)
            if size > self.max_tool_schema_bytes:
                raise LimitExceededError(f"tools[{i}]", "max_tool_schema_bytes", size,
                                         self.max_tool_schema_bytes,
                                         "bytes of tool definition JSON")


    def _formats(self, body: dict[str, Any]) -> None:
        """The JSON schema of ``response_format`` (OpenAI) and ``output_config.format``
        (Anthropic), bounded as a tool's definition is."""
        fmt, output = body.get("response_format"), body.get("output_config")
        spec = fmt.get("json_schema") if isinstance(fmt, dict) else None
        for field, holder in (("response_format.json_schema.schema", spec),
                              ("output_config.format.schema",
                               output.get("format") if isinstance(output, dict) else None)):
            if isinstance(holder, dict) and "schema" in holder:
                size = _compact_size(holder["schema"])
                if size > self.max_tool_schema_bytes:
                    raise LimitExceededError(field, "max_tool_schema_bytes", size,
                                             self.max_tool_schema_bytes,
                                             "bytes of JSON schema")
        spec = body.get("structured_outputs")
        constraints = [(f"structured_outputs.{k}", v) for k, v in spec.items()] \
            if isinstance(spec, dict) else []
        constraints += [(k, body[k]) for k in ("guided_json", "guided_regex", "guided_choice",
                                               "guided_grammar") if k in body]
        for field, value in constraints:
            size = _compact_size(value)
            if size > self.max_tool_schema_bytes:
                raise LimitExceededError(field, "max_tool_schema_bytes", size,
                                         self.max_tool_schema_bytes,
                                         "bytes of output constraint (schema, regular "
                                         "expression, choices or grammar)")


def _compact_size(value: Any) -> int:
    """Bytes of ``value`` as compact JSON (the door already refused lone surrogates)."""
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


def _message_units(messages: Any) -> int:
    """Messages, plus each content block and tool call in them: what a render iterates."""
    if not isinstance(messages, list):
        return 0
    units = len(messages)
    for message in messages:
        if isinstance(message, dict):
            for name in ("content", "tool_calls"):
                if isinstance(message.get(name), list):
                    units += len(message[name])
    return units


def text_chars(value: Any) -> int:
    """Characters of every string inside ``value``, keys included, without recursion."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            total += sum(len(k) for k in item if isinstance(k, str))
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total
