"""Hugging Face chat templates: loading, sandboxed rendering, and control/content spans.

Owns :class:`HFChatTemplateRenderer`. It compiles a template the way transformers'
``chat_template_utils`` does, so the text equals ``apply_chat_template(..., tokenize=False)``:
a :class:`jinja2.sandbox.ImmutableSandboxedEnvironment` with ``trim_blocks``,
``lstrip_blocks`` and ``loopcontrols``; a ``{% generation %}`` tag that renders its body; the
``tojson`` filter with HF's semantics (``ensure_ascii=False``, optional ``indent``,
``separators``, ``sort_keys``); globals ``raise_exception``, ``strftime_now``, a restricted
``dict`` and a ``namespace`` that refuses underscore names. One hardening over stock jinja:
touching an unsafe attribute (``().__class__``) fails at once, even where jinja would let an
undefined value pass silently. Variables are the named special tokens, then the caller's
template kwargs, then ``messages`` (``Message.to_template()``, with ``reasoning_content``
also given as ``thinking``), ``tools`` (``None`` when there are none), ``documents=None`` and
``add_generation_prompt``. Every failure inside the template is a
:class:`~pipeline.errors.TemplateError`.

Spans. A *caller string* is any string value in the message and tool mappings, except the
values of ``role`` and ``type`` keys; template kwargs belong to the application and render as
control. Spans are found in three steps:

1. protect: each special-token string inside a caller string (``<|im_end|>``) is replaced by
   a private-use placeholder character that occurs nowhere in the inputs;
2. locate: the template is rendered a second time with each caller string's non-blank core
   between an opening marker of its own and a closing marker (private-use characters). Where
   the two outputs agree (their common prefix and suffix, markers removed), each marker pair
   is an exact CONTENT span. Strings left over (the template split, sliced or tested them,
   which strands or moves their markers) are searched for where the outputs differ, in
   order, exact, stripped or JSON-escaped. No span covers a special token the template
   wrote itself;
3. restore: each placeholder becomes its special-token string again, inside a CONTENT span
   whatever step 2 found. So a caller's ``<|im_end|>`` is always content.

Only special tokens are protected: non-special added tokens (Qwen's ``<think>``,
``<tool_response>``) stay visible to templates, which split and test on them. A template that
inspects a special-token string inside caller text (``'<|im_end|>' in content``, ``upper``)
sees a placeholder instead; that is the one way the text can differ from transformers'.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from types import MappingProxyType
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pipeline.errors import InvalidValueError, TemplateError
from pipeline.events import digest_text
from pipeline.types import Message, Rendered, Span, SpanKind, ToolSpec

NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                        "cls_token", "mask_token")
"""The named special tokens passed into a template, as transformers' ``special_tokens_map``."""

RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
"""Template variables the renderer sets itself; template kwargs cannot use these names."""

_NOT_CALLER_KEYS = frozenset({"role", "type"})
_PRIVATE_USE = range(0x100000, 0x10FFFE)  # Supplementary Private Use Area-B


# --- the jinja environment ----------------------------------------------------------------


class _Sandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, failing at once on unsafe attributes instead of lazily."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body (transformers uses it to
    find assistant tokens; here it only has to compile)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _Namespace(jinja2.utils.Namespace):
    """jinja's ``namespace`` without underscore-prefixed attributes (no path to internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's trick: `self` may be a key
        self, rest = args[0], args[1:]
        values = dict(*rest, **kwargs)
        for key in values:
            _Namespace._check(key)
        jinja2.utils.Namespace.__init__(self, values)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a namespace cannot hold the underscore name {name!r}")


class _TemplateDict:
    """``dict(...)`` and ``dict.fromkeys(...)`` for templates, without the type object."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise TemplateError(str(message))


def compile_template(source: str, clock: Callable[[], datetime] = datetime.now
                     ) -> jinja2.Template:
    """Compile ``source`` like transformers does; a syntax error is a TemplateError."""
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True,
                   extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, dict=_TemplateDict(),
                       namespace=_Namespace,
                       strftime_now=lambda fmt: clock().strftime(fmt))
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"chat template syntax error, line {exc.lineno}: {exc.message}"
                            ) from exc


# --- template data ------------------------------------------------------------------------


def _map_caller(value: Any, fn: Callable[[str], str], key: object = None) -> Any:
    """A plain copy of ``value`` with ``fn`` applied to every caller string."""
    if isinstance(value, str):
        return value if key in _NOT_CALLER_KEYS else fn(value)
    if isinstance(value, Mapping):
        return {k: _map_caller(v, fn, k) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_caller(v, fn, key) for v in value)
    return value


def _caller_strings(value: Any, key: object = None) -> Iterator[str]:
    """Every caller string in ``value``, in order."""
    if isinstance(value, str):
        if key not in _NOT_CALLER_KEYS:
            yield value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _caller_strings(v, k)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _caller_strings(v, key)


def _message_data(message: Message) -> dict[str, Any]:
    """``to_template()``, with reasoning also under ``thinking`` as transformers passes it."""
    data = message.to_template()
    reasoning = data.get("reasoning_content")
    return data if reasoning is None else {"thinking": reasoning, **data}


def _free_chars(used: set[str], count: int) -> list[str]:
    chars = list(itertools.islice((chr(c) for c in _PRIVATE_USE if chr(c) not in used), count))
    if len(chars) < count:
        raise TemplateError("no free private-use characters left to mark caller text")
    return chars


def _wrap(text: str, open_: str, close: str) -> str:
    core = text.strip()
    if not core:
        return text
    lead = text.index(core)
    return f"{text[:lead]}{open_}{core}{close}{text[lead + len(core):]}"


# --- spans --------------------------------------------------------------------------------


def _unmark(wrapped: str, opens: Mapping[str, int], close: str
            ) -> tuple[str, list[tuple[int, int | None]]]:
    """``wrapped`` without markers, and each marker's position there with its probe index
    (``None`` for the closing marker)."""
    pattern = re.compile("[" + re.escape("".join(opens) + close) + "]")
    parts, marks, last, at = [], [], 0, 0
    for m in pattern.finditer(wrapped):
        parts.append(wrapped[last:m.start()])
        at, last = at + m.start() - last, m.end()
        marks.append((at, opens.get(m.group())))
    parts.append(wrapped[last:])
    return "".join(parts), marks


def _differing(a: str, b: str) -> tuple[int, int]:
    """Lengths of the common prefix and (not overlapping it) common suffix of ``a``, ``b``."""
    head = len(os.path.commonprefix([a, b]))
    room = min(len(a), len(b)) - head
    tail = len(os.path.commonprefix([a[::-1][:room], b[::-1][:room]]))
    return head, tail


def _marked_spans(wrapped: str, plain: str, opens: Mapping[str, int], close: str
                  ) -> tuple[list[tuple[int, int]], set[int], tuple[int, int]]:
    """Content spans of ``plain`` from the marker pairs of ``wrapped`` that lie where the two
    renders agree, the probes they resolve, and the stretch of ``plain`` where they differ."""
    stripped, marks = _unmark(wrapped, opens, close)
    head, tail = _differing(stripped, plain)
    shift, suffix = len(plain) - len(stripped), len(stripped) - tail
    spans, resolved = [], set()
    for (p, probe), (q, after) in zip(marks, marks[1:]):
        if probe is None or after is not None:
            continue
        if q <= head or p >= suffix:
            resolved.add(probe)
            offset = 0 if q <= head else shift
            spans += [(p + offset, q + offset)] if q > p else []
    return spans, resolved, (head, len(plain) - tail)


def _variants(probe: str) -> list[str]:
    forms = [probe, probe.strip("\n"), probe.strip()]
    forms += [json.dumps(f, ensure_ascii=False)[1:-1] for f in forms]
    return [f for i, f in enumerate(forms) if f and f not in forms[:i]]


def _find(text: str, probe: str, start: int, stop: int, claimed: list[tuple[int, int]]
          ) -> tuple[int, int] | None:
    for form in _variants(probe):
        at = text.find(form, start, stop)
        while at >= 0:
            end = at + len(form)
            if not any(s < end and at < e for s, e in claimed):
                return at, end
            at = text.find(form, at + 1, stop)
    return None


def _searched_spans(text: str, probes: Sequence[str], region: tuple[int, int],
                    claimed: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Best-effort content spans inside ``region``: probes in order, each first looked for
    after the previous hit, never overlapping ``claimed``."""
    lo, hi = region
    found = list(claimed)
    cursor = lo
    for probe in probes:
        hit = _find(text, probe, cursor, hi, found)
        if hit is not None:
            cursor = hit[1]
        elif (hit := _find(text, probe, lo, hi, found)) is None:
            continue
        found.append(hit)
    return found[len(claimed):]


def _subtract(spans: Sequence[tuple[int, int]], holes: Sequence[tuple[int, int]]
              ) -> list[tuple[int, int]]:
    """``spans`` with the sorted, disjoint ``holes`` cut out."""
    out = []
    for s, e in spans:
        for hs, he in holes:
            if hs < e and s < he:
                if s < hs:
                    out.append((s, hs))
                s = max(s, he)
        if s < e:
            out.append((s, e))
    return out


def _merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(e, merged[-1][1]))
        else:
            merged.append((s, e))
    return merged


def _assemble(text: str, content: list[tuple[int, int]], restore: Mapping[str, str]
              ) -> tuple[str, tuple[Span, ...]]:
    """Put special-token strings back (each inside content) and build the span partition."""
    pattern = re.compile("|".join(map(re.escape, restore)) or "(?!)")
    forced = [(m.start(), m.end()) for m in pattern.finditer(text)] if restore else []
    pieces: list[tuple[str, SpanKind]] = []
    at = 0
    for s, e in _merge(content + forced):
        pieces += [(text[at:s], SpanKind.CONTROL), (text[s:e], SpanKind.CONTENT)]
        at = e
    pieces.append((text[at:], SpanKind.CONTROL))
    out: list[str] = []
    spans: list[Span] = []
    pos = 0
    for piece, kind in pieces:
        piece = pattern.sub(lambda m: restore[m.group()], piece) if restore else piece
        if not piece:
            continue
        if spans and spans[-1].kind is kind:
            spans[-1] = Span(spans[-1].start, pos + len(piece), kind)
        else:
            spans.append(Span(pos, pos + len(piece), kind))
        out.append(piece)
        pos += len(piece)
    return "".join(out), tuple(spans)


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


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config spells it: a string or ``{"content": ...}``."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


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
        if (text := _token_text(config.get(key))) is not None:
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
        strings += [t for t in map(_token_text, extra if isinstance(extra, list) else []) if t]
    return strings


# --- the renderer -------------------------------------------------------------------------


class HFChatTemplateRenderer:
    """Renders messages with a Hugging Face chat template (a :class:`~pipeline.protocols.Renderer`).

    The text equals transformers' ``apply_chat_template(..., tokenize=False)`` for the same
    template, messages, tools and kwargs; ``spans`` mark the caller's text as CONTENT (see
    the module docstring). Immutable after construction; ``render`` is thread-safe.
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

        Raises TemplateError when the template fails, InvalidValueError for a kwarg named
        like a variable the renderer sets (``messages``, ``tools``, ...)."""
        for key in RESERVED_VARIABLES & template_kwargs.keys():
            raise InvalidValueError("template_kwargs", key, "is set by the renderer")
        msgs = [_message_data(m) for m in messages]
        tool_data = [t.to_template() for t in tools]
        kwargs = _plain(template_kwargs)
        inputs = [msgs, tool_data, kwargs, self.source, dict(self.special_tokens)]
        used = set(json.dumps(inputs, ensure_ascii=False, default=str, skipkeys=True))
        probes = list(_caller_strings([tool_data, msgs]))
        marks = _free_chars(used, len(self.special_token_strings) + 1 + len(probes))
        placeholders = marks[:len(self.special_token_strings)]
        protect = self._protector(placeholders)
        msgs, tool_data = _map_caller(msgs, protect), _map_caller(tool_data, protect)
        text = self._run(msgs, tool_data, add_generation_prompt, kwargs)
        content = self._content(text, [tool_data, msgs], add_generation_prompt, kwargs,
                                marks[len(placeholders):])
        restore = dict(zip(placeholders, self.special_token_strings, strict=True))
        restore |= {json.dumps(ph)[1:-1]: s for ph, s in restore.items()}
        final, spans = _assemble(text, content, restore)
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
        tools, msgs = _map_caller(data, lambda s: _wrap(s, next(opens), close))
        try:  # markers may change what the template does, even make it raise
            wrapped = self._run(msgs, tools, add_generation_prompt, kwargs)
        except TemplateError:
            wrapped = ""
        index = {m: i for i, m in enumerate(marks[1:])}
        spans, resolved, region = _marked_spans(wrapped, text, index, close)
        # Caller strings hold placeholders, so special tokens in ``text`` are the template's.
        own = [m.span() for m in self._special.finditer(text)] if self._special else []
        probes = [p for i, p in enumerate(_caller_strings(data)) if i not in resolved]
        spans += _searched_spans(text, probes, region, own + spans)
        return _subtract(spans, own)

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
