"""``pipeline``: language-model generation as an explicit, inspectable pipeline.

The public face: :func:`build` composes a :class:`Pipeline` from stages (with
:class:`BackendOptions` for the model backend), :class:`RequestOptions` (the typed keywords of
``generate``, ``stream`` and ``submit``), the value types of each data product, the stage
Protocols and every type their signatures name (a strategy's :class:`Plan`, :class:`Taken`,
:class:`Update`; a backend's :class:`ModelCall`), the exception tree rooted at
:class:`PipelineError`, and :data:`hookimpl` for plugins. Everything else is importable from
its module (``pipeline.events``, ``pipeline.testing``).
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
    from pipeline.engine.handle import RequestHandle, RequestState
    from pipeline.options import BackendOptions
    from pipeline.pipe import Pipeline
    from pipeline.errors import (
        ArtifactError, BackendError, CapacityError, ContextWindowError, DeviceFault,
        EngineClosed, InvalidValueError, InvariantViolation, LimitExceededError, OutOfBlocks, PipelineError,
        PluginLoadError, RegistryError, RequestCancelled, RequestError, RequestFailed,
        SlotError, StepStillRunning, TemplateError, TokenizerError, TraceError,
        UnknownFieldError, UnknownKeywordError, UnknownNameError, ValidationError,
    )
    from pipeline.events import EventSink
    from pipeline.engine.forcing import Forcing
    from pipeline.protocols import (
        Attention, Backend, Batch, Detokenizer, Honours, LogitProcessor, ModelCall, Plan,
        PrefillChunk, Renderer, Row, Scores, Selection, Selector, StopContext, Stopper, StopVerdict,
        Strategy, Taken, Tokenizer, ToolCallParser, ToolCallReader, Transport, Update,
    )
    from pipeline.request_options import RequestOptions
    from pipeline.strategy_choice import StrategyChoice
    from pipeline.registry import BuildContext, Component
    from pipeline.types import (
        Completion, Delta, FinishReason, GenerationConfig, Message, Recording, Rendered,
        Request, RuntimeLimits, TextPiece, TokenizedPrompt, TokenLogprob, ToolCall,
        ToolCallDelta, ToolCallEnd, ToolSpec, Usage,
    )

ERRORS = (
    "ArtifactError", "BackendError", "CapacityError", "ContextWindowError", "DeviceFault",
    "EngineClosed", "InvalidValueError", "InvariantViolation", "LimitExceededError", "OutOfBlocks",
    "PipelineError", "PluginLoadError", "RegistryError", "RequestCancelled", "RequestError",
    "RequestFailed", "SlotError", "StepStillRunning", "TemplateError", "TokenizerError",
    "TraceError", "UnknownFieldError", "UnknownKeywordError", "UnknownNameError",
    "ValidationError",
)
"""The library's exception tree (:mod:`pipeline.errors`), rooted at :class:`PipelineError`:
what a caller of :func:`build` and :class:`Pipeline` may catch. The HTTP server's own errors
extend it on the serving side (:mod:`transports.http.serving_errors`)."""

_HOMES = {
    "build": "pipeline.builder", "EngineConfig": "pipeline.engine", "Event": "pipeline.events",
    "Grammar": "pipeline.grammar", "RequestHandle": "pipeline.engine.handle",
    "RequestState": "pipeline.engine.handle",
    "BackendOptions": "pipeline.options", "Pipeline": "pipeline.pipe",
    "BuildContext": "pipeline.registry", "Component": "pipeline.registry",
    "EventSink": "pipeline.events", "Forcing": "pipeline.engine.forcing",
    "RequestOptions": "pipeline.request_options", "StrategyChoice": "pipeline.strategy_choice",
    **{name: "pipeline.errors" for name in ERRORS},
    **{name: "pipeline.protocols" for name in (
        "Attention", "Backend", "Batch", "Detokenizer", "Honours", "LogitProcessor", "ModelCall",
        "Plan", "PrefillChunk", "Renderer", "Row", "Scores", "Selection", "Selector", "StopContext",
        "Stopper", "StopVerdict", "Strategy", "Taken", "Tokenizer", "ToolCallParser",
        "ToolCallReader", "Transport", "Update")},
    **{name: "pipeline.types" for name in (
        "Completion", "Delta", "FinishReason", "GenerationConfig", "Message", "Recording",
        "Rendered", "Request", "RuntimeLimits", "TextPiece", "TokenizedPrompt", "TokenLogprob",
        "ToolCall", "ToolCallDelta", "ToolCallEnd", "ToolSpec", "Usage")},
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
    "Attention", "Backend", "BackendOptions", "Batch", "BuildContext", "Completion",
    "Component", "Delta", "Detokenizer", "EngineConfig", "Event", "EventSink", "FinishReason",
    "Forcing", "GenerationConfig", "Grammar", "Honours", "LogitProcessor", "Message", "ModelCall",
    "Pipeline", "Plan", "PrefillChunk", "Recording", "Rendered", "Renderer", "Request",
    "RequestHandle", "RequestOptions", "RequestState", "Row", "RuntimeLimits", "Scores",
    "Selection", "Selector", "StopContext", "StopVerdict", "Stopper", "Strategy",
    "StrategyChoice", "Taken", "TextPiece", "TokenLogprob", "TokenizedPrompt", "Tokenizer",
    "ToolCall", "ToolCallDelta", "ToolCallEnd", "ToolCallParser", "ToolCallReader", "ToolSpec",
    "Transport", "Update", "Usage", "build", "hookimpl",
    *ERRORS,
]
