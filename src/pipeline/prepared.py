"""A request made ready once: normalized, constrained, validated and rendered, then tokenized
when first asked.

Owns :class:`Prepared`, what :meth:`~pipeline.pipe.Pipeline.prepare` returns and
:meth:`~pipeline.pipe.Pipeline.submit` takes (docs/design.md §3, steps "normalize" to
"tokenize"). A gateway inspects it before submitting (the rendered text's size, whether the
prompt opened a think block, the exact token count) and changes only what does not touch the
prompt (the output budget, the limits, the request id and seed of each choice), so the chat
template runs once per request and the tokenizer at most once, however many checks look.

Example::

    prepared = pipe.prepare(messages, max_tokens=400)
    if len(prepared.tokens) + 400 > window:
        prepared = prepared.with_request(attrs.evolve(prepared.request, ...))
    handle = pipe.submit(prepared)
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from pipeline.errors import InvalidValueError
from pipeline.contracts.request import Request
from pipeline.contracts.text import Rendered, TokenizedPrompt

RENDERED_FROM = ("messages", "prompt", "prompt_ids", "tool_catalog", "tool_choice",
                 "template_kwargs")
"""The request fields the rendered text and its tokens are made from: a prepared request's
copy may change any field but these."""


@attrs.frozen
class Prepared:
    """``request`` (normalized, with a required tool call's constraint and the artifacts'
    versions), its ``rendered`` text, and its tokens on first use of :attr:`tokens`.

    ``source`` is the pipeline that prepared it (only that one submits it); copies made by
    :meth:`with_request` share the tokens, so the prompt is tokenized once for them all.
    """

    request: Request
    rendered: Rendered
    source: object = attrs.field(eq=False, repr=False)
    _encode: Callable[[Request, Rendered], TokenizedPrompt] = attrs.field(eq=False, repr=False)
    _tokens: list[TokenizedPrompt] = attrs.field(factory=list, eq=False, repr=False)

    @property
    def tokens(self) -> TokenizedPrompt:
        """The prompt's ids (tokenized on the first call, then kept)."""
        if not self._tokens:
            self._tokens.append(self._encode(self.request, self.rendered))
        return self._tokens[0]

    @property
    def tokenized(self) -> bool:
        """Whether :attr:`tokens` has been computed."""
        return bool(self._tokens)

    def with_request(self, request: Request) -> Prepared:
        """This prepared prompt for ``request``, a copy of :attr:`request` that changes none
        of :data:`RENDERED_FROM` (its budget, limits, id or seed, say); changing one is an
        :class:`~pipeline.errors.InvalidValueError` naming it (prepare that request anew)."""
        for name in RENDERED_FROM:
            if getattr(request, name) != getattr(self.request, name):
                raise InvalidValueError(name, "(changed)", "a prepared request's prompt cannot "
                                        "change: prepare the new request instead")
        return attrs.evolve(self, request=request)
