"""``pipeline``: language-model generation as an explicit, inspectable pipeline.

The public face: :func:`build` composes a :class:`Pipeline` from stages (with
:class:`BackendOptions` for the model backend), the value types of each data product, the
stage Protocols, and :data:`hookimpl` for plugins. Everything else is importable from its
module (``pipeline.events``, ``pipeline.testing``, ``pipeline.errors``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pipeline.hookspecs import hookimpl  # pluggy alone: cheap, and its entry is documented here

if TYPE_CHECKING:
    from pipeline.builder import build
    from pipeline.engine import EngineConfig
    from pipeline.events import Event
    from pipeline.grammar import Grammar
    from pipeline.handle import RequestHandle, RequestState
    from pipeline.options import BackendOptions
    from pipeline.pipe import Pipeline
    from pipeline.protocols import (
        Backend, Batch, Detokenizer, LogitProcessor, PrefillChunk, Renderer, Row, Scores,
        Selection, Selector, Stopper, Strategy, Tokenizer, Transport,
    )
    from pipeline.registry import BuildContext, Component
    from pipeline.types import (
        Completion, Delta, FinishReason, GenerationConfig, Message, Recording, Rendered,
        Request, RuntimeLimits, TokenizedPrompt, TokenLogprob, ToolCall, ToolSpec, Usage,
    )

_HOMES = {
    "build": "pipeline.builder", "EngineConfig": "pipeline.engine", "Event": "pipeline.events",
    "Grammar": "pipeline.grammar", "RequestHandle": "pipeline.handle",
    "RequestState": "pipeline.handle",
    "BackendOptions": "pipeline.options", "Pipeline": "pipeline.pipe",
    "BuildContext": "pipeline.registry", "Component": "pipeline.registry",
    **{name: "pipeline.protocols" for name in (
        "Backend", "Batch", "Detokenizer", "LogitProcessor", "PrefillChunk", "Renderer", "Row",
        "Scores", "Selection", "Selector", "Stopper", "Strategy", "Tokenizer", "Transport")},
    **{name: "pipeline.types" for name in (
        "Completion", "Delta", "FinishReason", "GenerationConfig", "Message", "Recording",
        "Rendered", "Request", "RuntimeLimits", "TokenizedPrompt", "TokenLogprob", "ToolCall",
        "ToolSpec", "Usage")},
}
"""Where each public name lives. They are imported on first use (PEP 562), so a command
line that only parses its arguments, or prints a line before it loads a model, does not
wait for torch first."""


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # imported once; later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})


__version__ = "0.1.0"

__all__ = [
    "Backend", "BackendOptions", "Batch", "BuildContext", "Completion", "Component", "Delta",
    "Detokenizer", "EngineConfig", "Event", "FinishReason", "GenerationConfig", "Grammar",
    "LogitProcessor", "Message",
    "Pipeline", "PrefillChunk", "Recording", "Rendered", "Renderer", "Request", "RequestHandle",
    "RequestState", "Row", "RuntimeLimits", "Scores", "Selection", "Selector", "Stopper",
    "Strategy", "TokenLogprob", "TokenizedPrompt", "Tokenizer", "ToolCall", "ToolSpec",
    "Transport", "Usage", "build", "hookimpl",
]
