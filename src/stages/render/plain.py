"""Role-labelled plain text, for models without a chat template.

Owns :class:`PlainRenderer`. The format (version 1) is, for each message in order::

    <Label>: <content>

with messages joined by a blank line (``"\\n\\n"``) and, when ``add_generation_prompt`` is
set, a final ``"Assistant:"`` (after a blank line if any message precedes it; no trailing
space, so the model writes the space). Labels: ``System``, ``Developer``, ``User``,
``Assistant``, ``Tool``. Example, a system and a user message::

    System: Be brief.\\n\\nUser: hi\\n\\nAssistant:

Labels (with their ``": "``), separators and the generation prompt are CONTROL; message
content is CONTENT. ``reasoning_content`` is not rendered (as most chat templates drop past
reasoning); tools and tool calls cannot be written in this format and raise
:class:`~pipeline.errors.TemplateError` rather than vanish. Template kwargs are accepted and
ignored, as a template ignores variables it does not read. A raw ``Request.prompt`` goes
through :meth:`PlainRenderer.render_prompt` unchanged, all content.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipeline.errors import TemplateError
from pipeline.events import digest_text
from pipeline.contracts.request import Message, ToolSpec
from pipeline.contracts.text import Rendered, Span, SpanKind

FORMAT = "plain-renderer:v1 '<Label>: <content>' joined by '\\n\\n', then 'Assistant:'"
"""What the digest of :class:`PlainRenderer` hashes: a name for the format above."""

LABELS = {"system": "System", "developer": "Developer", "user": "User",
          "assistant": "Assistant", "tool": "Tool"}
"""The label written for each message role."""


class PlainRenderer:
    """Renders messages as role-labelled plain text (a :class:`~pipeline.contracts.text.Renderer`).

    Stateless and thread-safe. Example::

        r = PlainRenderer()
        assert r.render([Message("user", "hi")]).text == "User: hi\\n\\nAssistant:"
    """

    name = "plain"
    digest = digest_text(FORMAT)

    def render(self, messages: Sequence[Message], *, tools: Sequence[ToolSpec] = (),
               add_generation_prompt: bool = True, **template_kwargs: Any) -> Rendered:
        """Render ``messages`` in the format of the module docstring.

        Raises TemplateError for tools or tool calls, which this format cannot express."""
        if tools:
            raise TemplateError("the plain renderer cannot render tools; use a chat template")
        pieces: list[tuple[str, SpanKind]] = []
        for i, message in enumerate(messages):
            if message.tool_calls:
                raise TemplateError("the plain renderer cannot render tool calls")
            if i:
                pieces.append(("\n\n", SpanKind.CONTROL))
            pieces += [(f"{LABELS[message.role]}: ", SpanKind.CONTROL),
                       (message.content or "", SpanKind.CONTENT)]
        if add_generation_prompt:
            prompt = "\n\nAssistant:" if messages else "Assistant:"
            pieces.append((prompt, SpanKind.CONTROL))
        return self._rendered(pieces)

    def render_prompt(self, text: str) -> Rendered:
        """Raw prompt text, unchanged and all content."""
        return Rendered.plain(text, self.digest, self.name)

    def _rendered(self, pieces: Sequence[tuple[str, SpanKind]]) -> Rendered:
        spans: list[Span] = []
        at = 0
        for text, kind in pieces:
            if not text:
                continue
            if spans and spans[-1].kind is kind:
                spans[-1] = Span(spans[-1].start, at + len(text), kind)
            else:
                spans.append(Span(at, at + len(text), kind))
            at += len(text)
        return Rendered("".join(t for t, _ in pieces), tuple(spans), self.digest, self.name)
