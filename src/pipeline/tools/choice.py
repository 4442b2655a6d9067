"""What a request's tool choice makes of its output, in the model's own call format.

Owns :func:`constrain_calls`, which the pipeline applies to every request with tools before
it is queued (in process and over HTTP alike), through the
:class:`~pipeline.tools.grammars.CallGrammars` a tool-call parser offers (the built-in
parsers' ``calls``: the grammars of :mod:`pipeline.tools.grammars`, one per format), and
:func:`special_marker`. Under :class:`~pipeline.contracts.request.ToolChoice`:

- ``required`` / a named tool: the output starts with the format's opening (forced tokens:
  ``<tool_call>``, ``[TOOL_CALLS]``, the named call's head) and follows the format's call
  grammar, so it always parses back as a call (one, or more when ``parallel``, never the
  same call twice: :attr:`~pipeline.grammar.Grammar.distinct_calls`), arguments valid for
  the tool's schema;
- ``auto`` with a JSON response format, ``strict`` tools, or ``parallel`` False: the model
  may answer, but a call it makes is valid (at most one when not ``parallel``);
- ``auto`` otherwise, and ``none``: nothing forced (``none`` also hides the tools, which is
  :meth:`~pipeline.contracts.request.Request.tools_shown`'s part); a grammar of the caller's own that is
  not a JSON format stands as it is.

A parser without :class:`CallGrammars` cannot have a call forced: the request is refused
naming the parser, never answered with a call the parser would not read.
"""

from __future__ import annotations

import json

import attrs

from pipeline.contracts.request import Request
from pipeline.contracts.text import Tokenizer, ToolCallParser
from pipeline.errors import InvalidValueError
from pipeline.grammar import Marker
from pipeline.tools.grammars import CallGrammars


def constrain_calls(request: Request, parser: ToolCallParser | None,
                    tokenizer: Tokenizer) -> Request:
    """``request`` with the forced prefix and grammar its tool choice asks for (see the
    module docstring); unchanged when it shows no tools or asks for nothing."""
    choice, tools = request.tool_choice, request.tools_shown
    config = request.generation_config
    if not tools:
        return request
    answer = config.grammar
    if answer is not None and answer.kind not in ("json_schema", "json_object") \
            and not choice.forced:
        return request   # the caller's own grammar (a tool-call grammar, say) stands
    if not (choice.forced or choice.strict or not choice.parallel or answer is not None):
        return request
    calls = getattr(parser, "calls", None)
    if not isinstance(calls, CallGrammars):
        name = getattr(parser, "name", None) if parser is not None else None
        raise InvalidValueError("tool_choice", choice.kind, (
            f"this model's tool-call parser ({name}) has no call grammar, so tool calls cannot "
            "be forced, limited or combined with a response format" if name else
            "this pipeline reads no tool calls (no tool-call parser)"))
    marker = special_marker(tokenizer)
    if choice.forced:
        if config.forced_prefix:
            raise InvalidValueError("forced_prefix", list(config.forced_prefix),
                                    "cannot be combined with a required tool call")
        forced = calls.forced(tools, choice.name, parallel=choice.parallel, marker=marker)
        ids = tuple(tokenizer.encode_text(forced.prefix, special=True))
        config = attrs.evolve(config, forced_prefix=ids, grammar=forced.grammar)
    else:
        config = attrs.evolve(config, grammar=calls.optional(
            tools, config.grammar, parallel=choice.parallel, marker=marker))
    return attrs.evolve(request, generation_config=config)


def special_marker(tokenizer: Tokenizer) -> Marker:
    """The :data:`~pipeline.grammar.Marker` of ``tokenizer``: a marker that encodes to one
    special token is that token (``<[id]>``), any other its text."""
    special = tokenizer.special_token_ids

    def marker(text: str) -> str:
        ids = tokenizer.encode_text(text, special=True)
        if len(ids) == 1 and ids[0] in special:
            return f"<[{ids[0]}]>"
        return json.dumps(text)

    return marker
