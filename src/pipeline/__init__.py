"""``pipeline``: language-model generation as an explicit, inspectable pipeline.

The public face: :func:`build` composes a :class:`Pipeline` from stages (with
:class:`BackendOptions` for the model backend), the value types of each data product, the
stage Protocols, and :data:`hookimpl` for plugins. Everything else is importable from its
module (``pipeline.events``, ``pipeline.testing``, ``pipeline.errors``).
"""

from pipeline.builder import build
from pipeline.engine import EngineConfig
from pipeline.events import Event
from pipeline.grammar import Grammar
from pipeline.handle import RequestHandle, RequestState
from pipeline.hookspecs import hookimpl
from pipeline.options import BackendOptions
from pipeline.pipe import Pipeline
from pipeline.protocols import (
    Backend, Batch, Detokenizer, LogitProcessor, PrefillChunk, Renderer, Row, Scores, Selection,
    Selector, Stopper, Strategy, Tokenizer, Transport,
)
from pipeline.registry import BuildContext, Component
from pipeline.types import (
    Completion, Delta, FinishReason, GenerationConfig, Message, Recording, Rendered, Request,
    RuntimeLimits, TokenizedPrompt, TokenLogprob, ToolCall, ToolSpec, Usage,
)

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
