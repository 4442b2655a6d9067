"""The jinja2 sandbox that Hugging Face chat templates run in, and their compilation.

Owns :func:`compile_template`, which builds the environment the way transformers'
``chat_template_utils`` does, so rendering equals ``apply_chat_template(..., tokenize=False)``:
a :class:`jinja2.sandbox.ImmutableSandboxedEnvironment` with ``trim_blocks``,
``lstrip_blocks`` and ``loopcontrols``; a ``{% generation %}`` tag that renders its body; the
``tojson`` filter with HF's semantics (``ensure_ascii=False``, optional ``indent``,
``separators``, ``sort_keys``); globals ``raise_exception``, ``strftime_now``, a restricted
``dict`` and a ``namespace`` that refuses underscore names. One hardening over stock jinja:
touching an unsafe attribute (``().__class__``) fails at once, even where jinja would let an
undefined value pass silently. A syntax error, and ``raise_exception`` called by a template,
are a :class:`~pipeline.errors.TemplateError`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pipeline.errors import TemplateError


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
