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

from typing import TYPE_CHECKING

from pipeline.hookspecs import hookimpl as hookimpl  # pluggy alone: cheap, and its entry is documented here
from pipeline.lazy import homes, lazy

# The public face, in one table: each name below is exported (``__all__``) and imported from
# its home on first use (PEP 562), so a command line that only parses its arguments, or prints
# a line before it loads a model, does not wait for torch first. A type checker reads the block
# as imports; at run time ``_HOMES`` and ``__all__`` are read from it.
if TYPE_CHECKING:
    from pipeline.builder import build as build
    from pipeline.contracts.decode import (
        Batch as Batch, LogitProcessor as LogitProcessor, Row as Row, Scores as Scores,
        Selection as Selection, Selector as Selector, StatefulProcessor as StatefulProcessor,
    )
    from pipeline.contracts.forcing import Forced as Forced, Forcing as Forcing
    from pipeline.contracts.model import (
        Attention as Attention, Backend as Backend, BackendHonours as BackendHonours,
        LayerTaps as LayerTaps, ModelCall as ModelCall, ModelInfo as ModelInfo,
        PagedBackend as PagedBackend, PrefillChunk as PrefillChunk,
    )
    from pipeline.contracts.output import (
        Completion as Completion, Delta as Delta, FinishReason as FinishReason, Part as Part,
        TextPart as TextPart, TextPiece as TextPiece, Timings as Timings,
        TokenLogprob as TokenLogprob, ToolCallDelta as ToolCallDelta, ToolCallEnd as ToolCallEnd,
        Usage as Usage,
    )
    from pipeline.contracts.request import (
        GenerationConfig as GenerationConfig, Message as Message, Recording as Recording,
        Request as Request, RuntimeLimits as RuntimeLimits, TapWindow as TapWindow,
        ToolCall as ToolCall, ToolChoice as ToolChoice, ToolSpec as ToolSpec,
    )
    from pipeline.contracts.strategy import (
        Honours as Honours, Plan as Plan, Strategy as Strategy, Taken as Taken, Update as Update,
    )
    from pipeline.contracts.text import (
        Detokenizer as Detokenizer, Rendered as Rendered, Renderer as Renderer, Span as Span,
        SpanKind as SpanKind, StopContext as StopContext, Stopper as Stopper,
        StopVerdict as StopVerdict, TokenizedPrompt as TokenizedPrompt, Tokenizer as Tokenizer,
        ToolCallParser as ToolCallParser, ToolCallReader as ToolCallReader,
    )
    from pipeline.contracts.transport import Transport as Transport
    from pipeline.engine.loop import EngineConfig as EngineConfig
    from pipeline.engine.handle import RequestHandle as RequestHandle, RequestState as RequestState
    from pipeline.errors import (
        ArtifactError as ArtifactError, BackendError as BackendError,
        CapacityError as CapacityError, ContextWindowError as ContextWindowError,
        DeviceFault as DeviceFault, EngineClosed as EngineClosed,
        InvalidValueError as InvalidValueError, InvariantViolation as InvariantViolation,
        LimitExceededError as LimitExceededError, OutOfBlocks as OutOfBlocks,
        PipelineError as PipelineError, PluginLoadError as PluginLoadError,
        RegistryError as RegistryError, RequestCancelled as RequestCancelled,
        RequestError as RequestError, RequestFailed as RequestFailed, SlotError as SlotError,
        StepStillRunning as StepStillRunning, TemplateError as TemplateError,
        TokenizerError as TokenizerError, TraceError as TraceError,
        UnknownFieldError as UnknownFieldError, UnknownKeywordError as UnknownKeywordError,
        UnknownNameError as UnknownNameError, ValidationError as ValidationError,
    )
    from pipeline.events import Event as Event, EventSink as EventSink
    from pipeline.grammar import Grammar as Grammar
    from pipeline.options import BackendOptions as BackendOptions
    from pipeline.pipe import Pipeline as Pipeline
    from pipeline.prepared import Prepared as Prepared
    from pipeline.registry import BuildContext as BuildContext, Component as Component
    from pipeline.request_options import RequestOptions as RequestOptions
    from pipeline.strategy_choice import StrategyChoice as StrategyChoice


_HOMES = homes(__file__)
"""Where each public name lives."""

ERRORS = tuple(sorted(name for name, home in _HOMES.items() if home == "pipeline.errors"))
"""The library's exception tree (:mod:`pipeline.errors`), rooted at :class:`PipelineError`:
what a caller of :func:`build` and :class:`Pipeline` may catch. The HTTP server's own errors
live with the server (:mod:`transports.http.serving_errors`)."""


__getattr__, __dir__ = lazy(__name__, _HOMES, globals())

__version__ = "0.1.0"

__all__ = sorted([*_HOMES, "hookimpl"])
