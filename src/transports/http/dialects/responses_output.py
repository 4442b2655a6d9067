"""The answer side of OpenAI's Responses API (``POST /v1/responses``): output items, the
``response`` object, its event stream, and the stored responses (for ``previous_response_id``,
``GET /v1/responses/{id}`` and ``DELETE /v1/responses/{id}``).

Owns :class:`Output` (an answer's parts, from :mod:`pipeline.output_parts`, as output items:
``reasoning`` for a ``<think>`` block, ``message`` with one ``output_text`` part,
``function_call``; and the stream events that build them; streamed or not, an answer goes
through it, so both give the same items), :class:`ResponsesForm` (the
:class:`~transports.http.server.generation.Form` a Responses request answers with: the non-stream
body, the stream encoder, the keeping of a finished conversation), :class:`ResponseStream`
(the named SSE events, each with its ``sequence_number``; a failure ends the stream with an
``error`` event), :class:`Echo` (what a response repeats of its request) and
:class:`Conversations` (the last ``capacity`` stored responses, each its conversation and
its finished ``response`` object, readable and deletable only with a key that made it). The
request side is :mod:`transports.http.dialects.responses`.
"""

from __future__ import annotations

import collections
import json
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import attrs

from pipeline.errors import InvalidValueError
from transports.http.serving_errors import ResponseNotFoundError
from pipeline.contracts.output import Completion, Delta, FinishReason, ToolCallDelta, ToolCallEnd
from pipeline.contracts.request import Message, ToolCall
from pipeline.contracts.output import Part, TextPart
from transports.http.server import generation
from transports.http.server.choices import total_usage
from transports.http.dialects.common import Parsed
from transports.http.server.errors import classify
from transports.http.gateway.models import ServedModel
from transports.sse import SSEEvent, encode

KEEP_RESPONSES = 256
"""Responses kept for ``previous_response_id`` by default (the oldest dropped first)."""

_CUT = (FinishReason.LENGTH, FinishReason.DEADLINE)


# --- kept responses --------------------------------------------------------------------------


@attrs.frozen
class _Kept:
    owners: frozenset[str]
    messages: tuple[Message, ...]
    response: str  # the finished response object, as JSON: a stored copy nobody can change


class Conversations:
    """The last ``capacity`` stored responses, by response id: each one's conversation (for
    ``previous_response_id``) and its finished ``response`` object (for ``GET``), readable
    and deletable only with a key whose fingerprint made it (by anyone when it was made
    without keys). Thread-safe; ``capacity`` 0 keeps nothing."""

    def __init__(self, capacity: int = KEEP_RESPONSES) -> None:
        self.capacity = capacity
        self._kept: collections.OrderedDict[str, _Kept] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)

    def keep(self, response_id: str, owners: frozenset[str], messages: Sequence[Message],
             response: dict[str, Any]) -> None:
        """Keep ``messages`` as ``response_id``'s conversation and ``response`` as its
        object; the oldest goes when full."""
        if not self.capacity:
            return
        with self._lock:
            self._kept[response_id] = _Kept(owners, tuple(messages),
                                            json.dumps(response, ensure_ascii=False))
            while len(self._kept) > self.capacity:
                self._kept.popitem(last=False)

    def _find(self, response_id: str, keys: frozenset[str]) -> _Kept | None:
        with self._lock:
            kept = self._kept.get(response_id)
        return None if kept is None or (kept.owners and not kept.owners & keys) else kept

    def messages(self, response_id: str, keys: frozenset[str]) -> tuple[Message, ...]:
        """The conversation of ``response_id`` for a caller presenting ``keys``; a 400 naming
        ``previous_response_id`` when none is kept for that caller."""
        kept = self._find(response_id, keys)
        if kept is None:
            raise InvalidValueError(
                "previous_response_id", response_id,
                f"no such response is kept here (unknown, stored with store=false, deleted, "
                f"made with another key, or dropped: the last {self.capacity} are kept)")
        return kept.messages

    def response(self, response_id: str, keys: frozenset[str]) -> dict[str, Any]:
        """``response_id``'s stored ``response`` object for a caller presenting ``keys``;
        :class:`~transports.http.serving_errors.ResponseNotFoundError` (a 404) when none is kept for it."""
        kept = self._find(response_id, keys)
        if kept is None:
            raise ResponseNotFoundError(response_id, self.capacity)
        return json.loads(kept.response)  # type: ignore[no-any-return]

    def delete(self, response_id: str, keys: frozenset[str]) -> None:
        """Forget ``response_id`` (its object and its conversation) for a caller presenting
        ``keys``; :class:`~transports.http.serving_errors.ResponseNotFoundError` when none is kept for it."""
        with self._lock:
            kept = self._kept.get(response_id)
            if kept is None or (kept.owners and not kept.owners & keys):
                raise ResponseNotFoundError(response_id, self.capacity)
            del self._kept[response_id]


RETRIEVE_QUERY = {"stream": ("false",)}
"""The query parameters ``GET /v1/responses/{id}`` takes, with their values: a stored response
comes back whole (OpenAI's ``stream=true`` replay of its events, ``starting_after`` and
``include`` are not kept here)."""


def check_retrieve_query(params: Sequence[tuple[str, str]]) -> None:
    """A 400 naming the first query parameter of a retrieval this server does not take."""
    for name, value in params:
        allowed = RETRIEVE_QUERY.get(name)
        if allowed is None:
            raise InvalidValueError(name, value, "a stored response is returned whole: no "
                                                 "query parameter but stream=false is taken")
        if value not in allowed:
            raise InvalidValueError(name, value, f"only {name}={allowed[0]} is taken: a stored "
                                                 "response's events are not kept for replay")


@attrs.frozen
class Echo:
    """What a response object repeats of its request."""

    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    previous_response_id: str | None
    effort: str | None
    store: bool
    text_format: dict[str, Any]
    tool_choice: Any
    tools: list[dict[str, Any]]



# --- output items ----------------------------------------------------------------------------


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class Output:
    """The output items of one response as its parts arrive, and the stream events that say
    so (each a dict with its ``type``, without ``sequence_number``). Streamed or not, an
    answer's parts go through this one class, so both give the same items."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: int | None = None  # the output index of the message or reasoning open
        self._calls: dict[int, int] = {}  # a tool call's index -> its output index
        self._ended: set[int] = set()  # output indexes of finished items

    def feed(self, parts: Sequence[Part]) -> list[dict[str, Any]]:
        """Events for ``parts``, in order."""
        events: list[dict[str, Any]] = []
        for part in parts:
            if isinstance(part, TextPart):
                self._text(part, events)
            elif isinstance(part, ToolCallDelta):
                self._call_delta(part, events)
            else:
                self._call_end(part, events)
        return events

    def close(self, status: str) -> list[dict[str, Any]]:
        """End every open item (``status``: ``completed`` or ``incomplete``); an answer with
        no item at all gets an empty message."""
        events: list[dict[str, Any]] = []
        if not self.items:
            self._start("message", events)
        self._close_open(status, events)
        for index in sorted(self._calls.values()):
            if index not in self._ended:  # a call the output cut short
                self._end_call(index, "incomplete", events)
        return events

    def message(self) -> Message:
        """The output as the assistant turn a later request continues."""
        text = "".join(c["text"] for i in self.items if i["type"] == "message"
                       for c in i["content"])
        thinking = "".join(c["text"] for i in self.items if i["type"] == "reasoning"
                           for c in i["content"])
        calls = [ToolCall(i["name"], i["arguments"], i["call_id"]) for i in self.items
                 if i["type"] == "function_call" and i["status"] == "completed"]
        return Message("assistant", text if text or not calls else None, calls,
                       reasoning_content=thinking or None)

    # --- text and reasoning

    def _text(self, part: TextPart, events: list[dict[str, Any]]) -> None:
        kind = "message" if part.kind == "text" else "reasoning"
        if self._open is None or self.items[self._open]["type"] != kind:
            self._close_open("completed", events)
            self._start(kind, events)
        assert self._open is not None
        item = self.items[self._open]
        item["content"][0]["text"] += part.text
        name = "output_text" if kind == "message" else "reasoning_text"
        event = {"type": f"response.{name}.delta", "item_id": item["id"],
                 "output_index": self._open, "content_index": 0, "delta": part.text}
        if kind == "message":
            event["logprobs"] = []
        events.append(event)

    def _start(self, kind: str, events: list[dict[str, Any]]) -> None:
        if kind == "message":
            item: dict[str, Any] = {"id": _item_id("msg"), "type": "message",
                                    "role": "assistant", "status": "in_progress",
                                    "content": []}
            part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [],
                                    "logprobs": []}
        else:
            item = {"id": _item_id("rs"), "type": "reasoning", "summary": [],
                    "status": "in_progress", "content": []}
            part = {"type": "reasoning_text", "text": ""}
        self._open = len(self.items)
        self.items.append(item)
        events.append({"type": "response.output_item.added", "output_index": self._open,
                       "item": _copy(item)})
        item["content"].append(part)
        events.append({"type": "response.content_part.added", "item_id": item["id"],
                       "output_index": self._open, "content_index": 0, "part": _copy(part)})

    def _close_open(self, status: str, events: list[dict[str, Any]]) -> None:
        index, self._open = self._open, None
        if index is None:
            return
        item = self.items[index]
        part = item["content"][0]
        name = "output_text" if item["type"] == "message" else "reasoning_text"
        done = {"type": f"response.{name}.done", "item_id": item["id"], "output_index": index,
                "content_index": 0, "text": part["text"]}
        if item["type"] == "message":
            done["logprobs"] = []
        item["status"] = status
        self._ended.add(index)
        events += [done,
                   {"type": "response.content_part.done", "item_id": item["id"],
                    "output_index": index, "content_index": 0, "part": _copy(part)},
                   {"type": "response.output_item.done", "output_index": index,
                    "item": _copy(item)}]

    # --- function calls

    def _call_delta(self, part: ToolCallDelta, events: list[dict[str, Any]]) -> None:
        if part.name is not None:  # a new call: its id and name first
            self._close_open("completed", events)
            index = self._calls[part.index] = len(self.items)
            item = {"id": _item_id("fc"), "type": "function_call", "status": "in_progress",
                    "call_id": part.id or _item_id("call"), "name": part.name,
                    "arguments": ""}
            self.items.append(item)
            events.append({"type": "response.output_item.added", "output_index": index,
                           "item": _copy(item)})
        index = self._calls[part.index]
        if part.arguments:
            item = self.items[index]
            item["arguments"] += part.arguments
            events.append({"type": "response.function_call_arguments.delta",
                           "item_id": item["id"], "output_index": index,
                           "delta": part.arguments})

    def _call_end(self, part: ToolCallEnd, events: list[dict[str, Any]]) -> None:
        index = self._calls.get(part.index)
        if index is None or index in self._ended:
            return
        if part.call is not None:
            item = self.items[index]
            item["arguments"] = part.call.arguments
            item["call_id"] = part.call.id or item["call_id"]
        self._end_call(index, "completed" if part.call is not None else "incomplete", events)

    def _end_call(self, index: int, status: str, events: list[dict[str, Any]]) -> None:
        item = self.items[index]
        item["status"] = status
        self._ended.add(index)
        events += [{"type": "response.function_call_arguments.done", "item_id": item["id"],
                    "output_index": index, "name": item["name"],
                    "arguments": item["arguments"]},
                   {"type": "response.output_item.done", "output_index": index,
                    "item": _copy(item)}]


def _copy(value: dict[str, Any]) -> dict[str, Any]:
    """A snapshot of an item or part as it is now (it changes as the answer goes on)."""
    return json.loads(json.dumps(value))  # type: ignore[no-any-return]


# --- the response ----------------------------------------------------------------------------


def _status(reason: FinishReason) -> str:
    return "incomplete" if reason in _CUT else "completed"


class ResponsesForm:
    """How a Responses request answers over the chat flow (a
    :class:`~transports.http.server.generation.Form`): the ``response`` object, or its event stream;
    a finished response's conversation is kept for ``previous_response_id`` when ``store``."""

    def __init__(self, echo: Echo, conversation: Sequence[Message],
                 conversations: Conversations, owners: frozenset[str]) -> None:
        self.echo = echo
        self._conversation = tuple(conversation)
        self._conversations = conversations
        self._owners = owners
        self.created_at = int(time.time())

    def body(self, parsed: Parsed, status: str, output: Output | None,
             completions: Sequence[Completion] = ()) -> dict[str, Any]:
        """The ``response`` object with ``status``, its items so far and, when finished, its
        usage."""
        e, config = self.echo, parsed.request.generation_config
        usage = None
        if completions:
            u = total_usage(completions, 1)
            usage = {"input_tokens": u.prompt_tokens,
                     "input_tokens_details": {"cached_tokens": u.cached_tokens,
                                              "cache_write_tokens": 0},
                     "output_tokens": u.completion_tokens,
                     "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": u.total_tokens}
        return {"id": parsed.request.request_id, "object": "response",
                "created_at": self.created_at, "status": status, "error": None,
                "incomplete_details": ({"reason": "max_output_tokens"}
                                       if status == "incomplete" else None),
                "instructions": e.instructions, "max_output_tokens": e.max_output_tokens,
                "model": parsed.model,
                "output": [_copy(i) for i in output.items] if output is not None else [],
                "parallel_tool_calls": e.parallel_tool_calls,
                "previous_response_id": e.previous_response_id,
                "reasoning": {"effort": e.effort, "summary": None}, "store": e.store,
                "temperature": config.temperature, "top_p": config.top_p,
                "text": {"format": e.text_format}, "tool_choice": e.tool_choice,
                "tools": e.tools, "truncation": "disabled", "usage": usage,
                "user": parsed.request.client_metadata.get("user"),
                "metadata": e.metadata}

    def finished(self, parsed: Parsed, output: Output, response: dict[str, Any]) -> None:
        """Keep the conversation with this output and the finished ``response``, when
        ``store``."""
        if self.echo.store:
            self._conversations.keep(parsed.request.request_id, self._owners,
                                     (*self._conversation, output.message()), response)

    def answer(self, served: ServedModel, parsed: Parsed, started: generation.Started,
               completions: Sequence[Completion]) -> dict[str, Any]:
        """The non-stream body."""
        (completion,) = completions
        output = Output()
        output.feed(generation.split(served, parsed, completion))
        status = _status(completion.finish_reason)
        output.close(status)
        body = self.body(parsed, status, output, completions)
        self.finished(parsed, output, body)
        return body

    def encoder(self, served: ServedModel, parsed: Parsed,
                started: generation.Started) -> ResponseStream:
        """The stream's encoder."""
        return ResponseStream(self, parsed)


class ResponseStream:
    """The events of one streamed response, as SSE bytes (each ``event:`` named by its
    ``type``, each with its ``sequence_number``): ``response.created`` and
    ``response.in_progress``; per item ``response.output_item.added``, its content part's
    ``added``, its deltas (``response.output_text.delta``, ``response.reasoning_text.delta``,
    ``response.function_call_arguments.delta``), their ``done`` and
    ``response.output_item.done``; then ``response.completed`` or ``response.incomplete`` with
    the whole response. A failure ends the stream with an ``error`` event."""

    def __init__(self, form: ResponsesForm, parsed: Parsed) -> None:
        self._form = form
        self._parsed = parsed
        self._output = Output()
        self._status = "completed"
        self._sequence = 0

    def _events(self, events: Sequence[dict[str, Any]]) -> bytes:
        out = []
        for event in events:
            event = {**event, "sequence_number": self._sequence}
            self._sequence += 1
            out.append(encode(SSEEvent(json.dumps(event, ensure_ascii=False), event["type"])))
        return b"".join(out)

    def start(self) -> bytes:
        """``response.created`` and ``response.in_progress``."""
        body = self._form.body(self._parsed, "in_progress", None)
        return self._events([{"type": "response.created", "response": body},
                             {"type": "response.in_progress", "response": body}])

    def delta(self, index: int, parts: Sequence[Part], delta: Delta) -> bytes:
        """The events of one engine delta's parts; its items closed after the last."""
        events = self._output.feed(parts)
        reason = delta.finish_reason
        if reason is not None and reason is not FinishReason.ERROR:
            self._status = _status(reason)
            events += self._output.close(self._status)
        return self._events(events)

    def end(self, completions: Sequence[Completion]) -> bytes:
        """``response.completed`` (or ``response.incomplete``) with the whole response."""
        body = self._form.body(self._parsed, self._status, self._output, completions)
        self._form.finished(self._parsed, self._output, body)
        return self._events([{"type": f"response.{self._status}", "response": body}])

    def fail(self, exc: BaseException) -> bytes:
        """The ``error`` event that ends a stream whose generation failed."""
        info = classify(exc)
        return self._events([{"type": "error", "code": info.code or info.openai_type,
                              "message": info.message, "param": info.param}])
