"""Hugging Face chat templates: the renderer, and finding a model folder's template.

Owns :class:`HFChatTemplateRenderer` and template lookup (:func:`find_template`,
:func:`named_special_tokens`, :func:`special_token_strings_of`, used by
:meth:`HFChatTemplateRenderer.from_dir`). The template is compiled in the sandbox of
:mod:`stages.render.sandbox` (:func:`compile_template`, re-exported here), so the text equals
transformers' ``apply_chat_template(..., tokenize=False)``. Variables are the named special
tokens, then the caller's template kwargs, then ``messages`` (``Message.to_template()``, with
``reasoning_content`` also given as ``thinking``), ``tools`` (``None`` when there are none),
``documents=None`` and ``add_generation_prompt``. Every failure inside the template is a
:class:`~pipeline.errors.TemplateError`. Control/content spans are recovered as
:mod:`stages.render.spans` describes: caller text is CONTENT, a caller's special-token string
(``<|im_end|>``) included. A template that renders no tools gets them through the Hermes
fallback of :mod:`pipeline.tools.fallback`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from types import MappingProxyType
from typing import Any

import attrs
import jinja2

from pipeline.errors import InvalidValueError, TemplateError
from pipeline.events import digest_text
from pipeline.contracts.request import Message, ToolSpec
from pipeline.contracts.text import Rendered
from pipeline.tools.fallback import SUFFIX, hermes_messages, renders_tools
from stages.render.sandbox import compile_template
from stages.render.spans import (assemble, caller_strings, free_chars, map_caller, marked_spans,
                                 searched_spans, subtract, wrap)
from stages.tokenize.hf import NAMED_SPECIAL_TOKENS, token_text

__all__ = ["RESERVED_VARIABLES", "HFChatTemplateRenderer", "compile_template", "find_template",
           "named_special_tokens", "special_token_strings_of"]

RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
"""Template variables the renderer sets itself; template kwargs cannot use these names."""


# --- template data ------------------------------------------------------------------------


def _message_data(message: Message) -> dict[str, Any]:
    """``to_template()``, with reasoning also under ``thinking`` as transformers passes it."""
    data = message.to_template()
    reasoning = data.get("reasoning_content")
    return data if reasoning is None else {"thinking": reasoning, **data}


def _plain(value: Any) -> Any:
    """Mappings as dicts, recursively, so the sandbox sees plain JSON-like data."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


# --- loading ------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path`` ({} if the file is absent); TemplateError if unreadable."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TemplateError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise TemplateError(f"{path} does not hold a JSON object")
    return data


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TemplateError(f"cannot read {path}: {exc}") from exc


def find_template(folder: Path, config: Mapping[str, Any], name: str | None) -> str:
    """The template source: ``chat_template.jinja`` (or ``additional_chat_templates/
    <name>.jinja``), else tokenizer_config's ``chat_template`` string or named list entry."""
    wanted = name or "default"
    file = (folder / "chat_template.jinja" if wanted == "default"
            else folder / "additional_chat_templates" / f"{wanted}.jinja")
    if file.is_file():
        return _read_text(file)
    value = config.get("chat_template")
    if isinstance(value, str) and wanted == "default":
        return value
    if isinstance(value, list):
        for entry in value:
            if isinstance(entry, Mapping) and entry.get("name") == wanted:
                return str(entry["template"])
    raise TemplateError(f"no chat template {wanted!r} in {folder}: looked for {file.name} "
                        "and tokenizer_config.json's chat_template")


def named_special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """``bos_token``, ``eos_token``, ... from tokenizer_config, as strings (unset ones left out)."""
    out = {}
    for key in NAMED_SPECIAL_TOKENS:
        if (text := token_text(config.get(key))) is not None:
            out[key] = text
    return out


def special_token_strings_of(folder: Path, config: Mapping[str, Any]) -> list[str]:
    """Special added tokens (tokenizer_config's ``added_tokens_decoder``, else tokenizer.json's
    ``added_tokens``), the named ones and ``additional_special_tokens``."""
    added = config.get("added_tokens_decoder")
    entries = list(added.values()) if isinstance(added, Mapping) else (
        _read_json(folder / "tokenizer.json").get("added_tokens") or [])
    strings = [str(e["content"]) for e in entries if isinstance(e, Mapping) and e.get("special")]
    strings += named_special_tokens(config).values()
    for key in ("additional_special_tokens", "extra_special_tokens"):
        extra = config.get(key) or []
        strings += [t for t in map(token_text, extra if isinstance(extra, list) else []) if t]
    return strings


# --- the renderer -------------------------------------------------------------------------


class HFChatTemplateRenderer:
    """Renders messages with a Hugging Face chat template (a :class:`~pipeline.contracts.text.Renderer`).

    The text equals transformers' ``apply_chat_template(..., tokenize=False)`` for the same
    template, messages, tools and kwargs; ``spans`` mark the caller's text as CONTENT (see
    :mod:`stages.render.spans`). Immutable after construction; ``render`` is thread-safe.
    Differences from transformers: a folder's named templates are chosen at construction
    (``template_name``), never switched to ``"tool_use"`` because tools were passed, and
    unsafe attribute access fails at once.

    Example::

        r = HFChatTemplateRenderer.from_dir("model/")
        out = r.render([Message("user", "hi")], enable_thinking=False)
    """

    def __init__(self, source: str, *, special_tokens: Mapping[str, str] | None = None,
                 special_token_strings: Sequence[str] | None = None,
                 name: str = "hf_chat_template",
                 clock: Callable[[], datetime] = datetime.now) -> None:
        """Compile ``source``. ``special_tokens`` are template variables (``eos_token``);
        ``special_token_strings`` (default: their values) are protected in caller text;
        ``clock`` feeds ``strftime_now``. Raises TemplateError for a syntax error."""
        self.source = source
        self.name = name
        self.digest = digest_text(source)
        self.special_tokens: Mapping[str, str] = MappingProxyType(dict(special_tokens or {}))
        strings = self.special_tokens.values() if special_token_strings is None \
            else special_token_strings
        self.special_token_strings = tuple(sorted({s for s in strings if s},
                                                  key=lambda s: (-len(s), s)))
        self._special = (re.compile("|".join(map(re.escape, self.special_token_strings)))
                         if self.special_token_strings else None)
        self._template = compile_template(source, clock)
        self._shows_tools: bool | None = None

    @classmethod
    def from_template(cls, source: str, *, special_tokens: Mapping[str, str] | None = None,
                      special_token_strings: Sequence[str] | None = None
                      ) -> HFChatTemplateRenderer:
        """A renderer for template text ``source`` (see ``__init__``)."""
        return cls(source, special_tokens=special_tokens,
                   special_token_strings=special_token_strings)

    @classmethod
    def from_dir(cls, path: str | Path, *, template_name: str | None = None,
                 special_token_strings: Sequence[str] | None = None) -> HFChatTemplateRenderer:
        """The template of a model folder (:func:`find_template`), with tokenizer_config's
        special tokens; ``template_name`` picks a named template other than ``"default"``."""
        folder = Path(path)
        config = _read_json(folder / "tokenizer_config.json")
        source = find_template(folder, config, template_name)
        strings = special_token_strings if special_token_strings is not None \
            else special_token_strings_of(folder, config)
        name = "hf_chat_template" + (f":{template_name}" if template_name else "")
        return cls(source, special_tokens=named_special_tokens(config),
                   special_token_strings=strings, name=name)

    def render(self, messages: Sequence[Message], *, tools: Sequence[ToolSpec] = (),
               add_generation_prompt: bool = True, **template_kwargs: Any) -> Rendered:
        """Render ``messages`` and ``tools``; ``template_kwargs`` reach the template.

        A template that renders no tools gets them through the Hermes fallback
        (:mod:`pipeline.tools.fallback`): the tool block in the system message, calls and
        results as text; the rendering's name then ends in ``+hermes_tools``.

        Raises TemplateError when the template fails, InvalidValueError for a kwarg named
        like a variable the renderer sets (``messages``, ``tools``, ...)."""
        for key in RESERVED_VARIABLES & template_kwargs.keys():
            raise InvalidValueError("template_kwargs", key, "is set by the renderer")
        calls = any(m.tool_calls or m.role == "tool" for m in messages)
        if (tools or calls) and not self.shows_tools:   # calls in the history need it too
            out = self._render(hermes_messages(messages, tools), (), add_generation_prompt,
                               template_kwargs)
            return attrs.evolve(out, renderer=self.name + SUFFIX)
        return self._render(messages, tools, add_generation_prompt, template_kwargs)

    @property
    def shows_tools(self) -> bool:
        """Whether the template renders the tools it is given (else the Hermes fallback
        does; measured once, on a probe conversation)."""
        if self._shows_tools is None:
            self._shows_tools = renders_tools(
                lambda messages, tools: self._render(messages, tools, True, {}))
        return self._shows_tools

    def _render(self, messages: Sequence[Message], tools: Sequence[ToolSpec],
                add_generation_prompt: bool, template_kwargs: Mapping[str, Any]) -> Rendered:
        msgs = [_message_data(m) for m in messages]
        tool_data = [t.to_template() for t in tools]
        kwargs = _plain(template_kwargs)
        inputs = [msgs, tool_data, kwargs, self.source, dict(self.special_tokens)]
        used = set(json.dumps(inputs, ensure_ascii=False, default=str, skipkeys=True))
        probes = list(caller_strings([tool_data, msgs]))
        marks = free_chars(used, len(self.special_token_strings) + 1 + len(probes))
        placeholders = marks[:len(self.special_token_strings)]
        protect = self._protector(placeholders)
        msgs, tool_data = map_caller(msgs, protect), map_caller(tool_data, protect)
        text = self._run(msgs, tool_data, add_generation_prompt, kwargs)
        content = self._content(text, [tool_data, msgs], add_generation_prompt, kwargs,
                                marks[len(placeholders):])
        restore = dict(zip(placeholders, self.special_token_strings, strict=True))
        restore |= {json.dumps(ph)[1:-1]: s for ph, s in restore.items()}
        final, spans = assemble(text, content, restore)
        return Rendered(final, spans, self.digest, self.name)

    def render_prompt(self, text: str) -> Rendered:
        """Raw prompt text (``Request.prompt``), unchanged and all content, untemplated."""
        return Rendered.plain(text, self.digest, self.name)

    def _protector(self, placeholders: Sequence[str]) -> Callable[[str], str]:
        special = self._special
        if special is None:
            return lambda s: s
        lookup = dict(zip(self.special_token_strings, placeholders, strict=True))
        return lambda s: special.sub(lambda m: lookup[m.group()], s)

    def _content(self, text: str, data: list[list[dict[str, Any]]],
                 add_generation_prompt: bool, kwargs: Mapping[str, Any], marks: Sequence[str]
                 ) -> list[tuple[int, int]]:
        """Content spans of ``text``: marker pairs from a second render where it agrees with
        the first, search where it does not; never a special token the template wrote."""
        close, opens = marks[0], iter(marks[1:])
        tools, msgs = map_caller(data, lambda s: wrap(s, next(opens), close))
        try:  # markers may change what the template does, even make it raise
            wrapped = self._run(msgs, tools, add_generation_prompt, kwargs)
        except TemplateError:
            wrapped = ""
        index = {m: i for i, m in enumerate(marks[1:])}
        spans, resolved, region = marked_spans(wrapped, text, index, close)
        # Caller strings hold placeholders, so special tokens in ``text`` are the template's.
        own = [m.span() for m in self._special.finditer(text)] if self._special else []
        probes = [p for i, p in enumerate(caller_strings(data)) if i not in resolved]
        spans += searched_spans(text, probes, region, own + spans)
        return subtract(spans, own)

    def _run(self, msgs: list[dict[str, Any]], tools: list[dict[str, Any]],
             add_generation_prompt: bool, kwargs: Mapping[str, Any]) -> str:
        variables = {**self.special_tokens, **kwargs, "messages": msgs,
                     "tools": tools or None, "documents": None,
                     "add_generation_prompt": add_generation_prompt}
        try:
            return self._template.render(**variables)
        except TemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template {self.name}: {type(exc).__name__}: {exc}"
                                ) from exc
        except Exception as exc:  # the template is foreign code: any failure is its failure
            raise TemplateError(f"chat template {self.name} failed: {type(exc).__name__}: "
                                f"{exc}") from exc
