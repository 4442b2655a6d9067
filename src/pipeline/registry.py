"""The component registry: names to factories, filled through pluggy hooks.

Owns :class:`Component`, :class:`BuildContext` and :class:`Registry`. A registry is built per
:func:`pipeline.build` call (no module-level state): it loads every plugin of the ``pipeline``
entry-point group plus any plugin objects passed in, asks each for its components, and
resolves ``(kind, name)`` to a factory. Errors: a plugin that fails to load or answer raises
:class:`~pipeline.errors.PluginLoadError` naming it; an unknown name raises
:class:`~pipeline.errors.UnknownNameError` listing the names that exist.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import attrs
import pluggy

from pipeline import hookspecs
from pipeline.errors import InvalidValueError, PluginLoadError, UnknownNameError
from pipeline.options import BackendOptions

if TYPE_CHECKING:
    from pipeline.contracts.model import Backend
    from pipeline.contracts.text import Tokenizer

KINDS = ("renderer", "tokenizer", "backend", "processor", "selector", "detokenizer",
         "stopper", "transport", "strategy", "tool_parser", "tool", "tool_policy")
ENTRY_POINT_GROUP = "pipeline"
DEFAULT_ORDER: tuple[str, ...] = (
    "allowed_tokens", "banned_tokens", "logit_bias", "min_tokens", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "dry", "temperature", "top_k", "top_p", "min_p",
    "typical_p",
)
"""The built-in processors (:mod:`stages.process`) in the order the default chain applies
them; the builder's default chain puts ``grammar`` first."""
DEFAULT_STOPPERS = ("eos", "max_tokens", "stop_strings", "deadline")
"""The built-in stoppers (:mod:`stages.stop`), in order; ``build(stoppers=[...])`` adds after
them."""


@attrs.frozen
class BuildContext:
    """What a factory may use: the model/tokenizer folder, or the single model file (a GGUF
    file), the tokenizer once built, the build's backend options (``build(...,
    options=...)``, a :class:`~pipeline.options.BackendOptions`; a third-party backend reads
    its own settings from ``options.extra``), ``shared``, a memo the factories of one build
    may share (e.g. a model file opened once for its tokenizer, template and weights), the
    model backend once built (strategies are made after it: a speculative strategy sizes its
    draft model by it), the strategy's own options (``build(..., strategy_options=...)``,
    checked by the strategy's factory), and ``load_model``, the builder's
    ``load_backend(model, options=...)`` for a factory that loads a second model (a draft)."""

    model_dir: Path | None = None
    tokenizer: Tokenizer | None = None
    options: BackendOptions = attrs.field(factory=BackendOptions)
    model_file: Path | None = None
    shared: dict[str, Any] = attrs.field(factory=dict, eq=False)
    backend: Backend | None = attrs.field(default=None, eq=False)
    strategy_options: Mapping[str, Any] = attrs.field(factory=dict, eq=False)
    load_model: Callable[..., tuple[Backend, Tokenizer]] | None = attrs.field(default=None,
                                                                               eq=False)


@attrs.frozen
class Component:
    """A named factory of one kind of stage."""

    kind: str = attrs.field()
    name: str
    factory: Callable[[BuildContext], Any]
    summary: str = ""
    plugin: str = ""

    @kind.validator
    def _kind(self, _: attrs.Attribute[str], value: str) -> None:
        if value not in KINDS:
            raise InvalidValueError("kind", value, f"must be one of {', '.join(KINDS)}")


class Registry:
    """Components by (kind, name), gathered from plugins through ``pipeline_components``."""

    def __init__(self, plugins: Iterable[object] = (), *, entry_points: bool = True) -> None:
        self._pm = pluggy.PluginManager(hookspecs.PROJECT)
        self._pm.add_hookspecs(hookspecs)
        if entry_points:
            self._load_entry_points()
        for plugin in plugins:
            self.register(plugin)

    def _load_entry_points(self) -> None:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if self._pm.get_plugin(ep.name) is not None:
                continue
            try:
                self._pm.register(ep.load(), name=ep.name)
            except Exception as exc:  # any import failure is the plugin's, name it
                raise PluginLoadError(ep.name, exc) from exc

    def register(self, plugin: object, name: str | None = None) -> None:
        """Add a plugin object (a module or an instance with ``@hookimpl`` methods)."""
        try:
            self._pm.register(plugin, name=name)
        except Exception as exc:
            raise PluginLoadError(name or repr(plugin), exc) from exc

    def components(self) -> list[Component]:
        """Every registered component, in plugin registration order."""
        out: list[Component] = []
        for impl in self._pm.hook.pipeline_components.get_hookimpls():
            try:
                found = cast("Iterable[Component]", impl.function())
            except Exception as exc:
                raise PluginLoadError(impl.plugin_name, exc) from exc
            out.extend(attrs.evolve(c, plugin=c.plugin or impl.plugin_name) for c in found)
        return out

    def names(self, kind: str) -> list[str]:
        """Names registered for ``kind``, sorted."""
        return sorted({c.name for c in self.components() if c.kind == kind})

    def get(self, kind: str, name: str) -> Component:
        """The component ``name`` of ``kind``; the last plugin registered wins a name clash."""
        found = None
        for comp in self.components():
            if comp.kind == kind and comp.name == name:
                found = comp
        if found is None:
            raise UnknownNameError(kind, name, self.names(kind))
        return found

    def create(self, kind: str, name: str, context: BuildContext) -> Any:
        """Build the named component with ``context``."""
        return self.get(kind, name).factory(context)
