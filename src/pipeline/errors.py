"""The one exception tree of the library.

Every error the library raises on purpose is a :class:`PipelineError`. Transports map this
tree to HTTP statuses and dialect error bodies in exactly one place; nothing else inspects it.

::

    PipelineError
    ├── ValidationError (also ValueError)      bad input from a caller
    │   ├── InvalidValueError                    a field holds a value outside its domain
    │   ├── UnknownFieldError                    a key that the type does not have
    │   │   └── UnknownKeywordError (also TypeError)  a keyword a function does not take
    │   ├── TraceError                           a trace file that cannot be read as traces
    │   ├── ContextWindowError                   prompt (+ max_tokens) does not fit the window
    │   └── LimitExceededError                   a request exceeds a configured size limit
    ├── RegistryError (also LookupError)       plugin registry
    │   ├── UnknownNameError                     a stage name nobody registered
    │   └── PluginLoadError                      a plugin failed to import or register
    ├── ArtifactError                          a template, tokenizer or model file is unusable
    │   ├── TemplateError                        the chat template failed to render
    │   └── TokenizerError                       tokenizer files missing or inconsistent
    ├── BackendError                           the model backend failed
    │   ├── SlotError                            a failure confined to named slots
    │   └── CapacityError                        no free slot / cache space
    │       └── OutOfBlocks                        no free or evictable KV block
    ├── RequestError                           raised from a handle's ``result()``
    │   ├── RequestFailed                        the request ended in state ``failed``
    │   └── RequestCancelled                     the request ended in state ``cancelled``
    ├── EngineClosed                           the engine no longer accepts work
    │   └── StepStillRunning                     an abandoned engine's step has not returned
    ├── DeviceFault                            the device is unusable: the engine loop stops
    └── InvariantViolation                     a live-checked trace broke a docs/design.md §8 rule

The HTTP server's own refusals (a key, a model name, capacity, a body's media type or size, a
client gone) extend this tree on the serving side: :mod:`transports.http.serving_errors`.

:func:`out_of_memory` and :func:`device_fault` sort a failure the engine or a backend caught:
a step that did not fit, or a device that is unusable.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import reprlib
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


def brief(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to about ``limit`` characters: error messages echo client input,
    which may be megabytes long. (``repr`` escapes lone surrogates, so the message stays
    encodable.)"""
    if isinstance(value, str) and len(value) > limit:
        return repr(value[:limit]) + f"... ({len(value)} characters)"
    text = _bounded_repr(limit).repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _bounded_repr(limit: int) -> reprlib.Repr:
    """A ``repr`` that looks at a few levels and items only (3.11's ``Repr`` takes no
    keyword arguments)."""
    shape = reprlib.Repr()
    shape.maxlevel, shape.maxstring, shape.maxother, shape.maxlong = 3, limit, limit, limit
    shape.maxlist = shape.maxtuple = shape.maxdict = shape.maxset = 8
    return shape


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The choice most like ``word`` (a likely misspelling of it), or None when none is close:
    what "did you mean ...?" hints suggest."""
    found = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return found[0] if found else None


class PipelineError(Exception):
    """Root of every exception the library raises on purpose. Every one pickles and comes
    back whole (its message and attributes), whatever its constructor takes: an engine in
    another process sends them back (:mod:`pipeline.runtime.parent`)."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _rebuilt, (type(self), self.args, dict(self.__dict__))


def _rebuilt(cls: type[PipelineError], args: tuple[Any, ...],
             state: dict[str, Any]) -> PipelineError:
    """:meth:`PipelineError.__reduce__`'s inverse, without calling the subclass's
    constructor."""
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


class ValidationError(PipelineError, ValueError):
    """Input from a caller is not acceptable; nothing was started."""


class InvalidValueError(ValidationError):
    """``field`` holds ``value``, which is outside its domain (``reason`` says why)."""

    def __init__(self, field: str, value: object, reason: str) -> None:
        self.field = field
        self.value = value
        self.reason = reason
        super().__init__(f"{field}={brief(value)}: {reason}")


class UnknownFieldError(ValidationError):
    """A mapping had a key the target type does not define; nothing is dropped silently."""

    def __init__(self, type_name: str, field: str, allowed: Iterable[str]) -> None:
        self.type_name = type_name
        self.field = field
        self.allowed = tuple(sorted(allowed))
        # compare the last path component ("messages[0].contnet" -> "contnet")
        self.suggestion = closest(field.rsplit(".", 1)[-1],
                                  [a.rsplit(".", 1)[-1] for a in self.allowed])
        hint = f" (did you mean {self.suggestion!r}?)" if self.suggestion else ""
        super().__init__(
            f"{type_name} has no field {field!r}{hint}; known fields: {', '.join(self.allowed)}"
        )


class UnknownKeywordError(UnknownFieldError, TypeError):
    """A function was called with a keyword it does not take (``build(devcie=...)``): the
    message names the closest keyword it does take. Also a ``TypeError``, what Python raises
    for it."""

    def __init__(self, function: str, keyword: str, allowed: Iterable[str]) -> None:
        super().__init__(f"{function}()", keyword, allowed)
        hint = f" (did you mean {self.suggestion!r}?)" if self.suggestion else ""
        self.args = (f"{function}() takes no keyword {keyword!r}{hint}; its keywords: "
                     f"{', '.join(self.allowed)}",)


def hint_keywords(function: Callable[P, R]) -> Callable[P, R]:
    """``function`` refusing a keyword it does not take with an :class:`UnknownKeywordError`
    that names the closest one (Python's own ``TypeError`` names none). The signature, and
    so static checking, is unchanged."""
    names = frozenset(name for name, p in inspect.signature(function).parameters.items()
                      if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))

    @functools.wraps(function)
    def checked(*args: P.args, **kwargs: P.kwargs) -> R:
        for keyword in kwargs:
            if keyword not in names:
                raise UnknownKeywordError(function.__name__, keyword, names)
        return function(*args, **kwargs)

    return checked


class TraceError(ValidationError):
    """A trace (file or event list) that cannot be read or is not what was asked for."""
class ContextWindowError(ValidationError):
    """The prompt, or the prompt plus ``max_tokens``, does not fit the context window.

    ``prompt_tokens`` and ``limit`` are the numbers (``limit`` is the most the window allows for
    what ``field`` measures); ``requested`` is the ``max_tokens`` asked for, when that is what
    did not fit. ``lower_bound``: ``prompt_tokens`` is a bound from the prompt's length, not a
    count (the prompt was refused before tokenizing).
    """

    def __init__(self, field: str, prompt_tokens: int, limit: int,
                 requested: int | None = None, *, lower_bound: bool = False) -> None:
        self.field = field
        self.prompt_tokens = prompt_tokens
        self.limit = limit
        self.requested = requested
        if requested is None:
            count = (f"at least {prompt_tokens} tokens (by its length, not counted)"
                     if lower_bound else f"{prompt_tokens} tokens")
            message = f"prompt is too long: {count} > {limit} maximum"
        else:
            message = (f"{field}={requested} is too large: the prompt has {prompt_tokens} "
                       f"tokens, leaving room for {limit} output tokens")
        super().__init__(message)


class LimitExceededError(ValidationError):
    """A request exceeds the server's limit ``limit`` (a setting's name) on ``field``:
    ``value`` is what the request has, ``maximum`` what the limit allows."""

    def __init__(self, field: str, limit: str, value: int, maximum: int, what: str) -> None:
        self.field = field
        self.limit = limit
        self.value = value
        self.maximum = maximum
        super().__init__(f"{field}: {value} {what} exceeds the limit of {maximum} "
                         f"(server setting {limit})")


class RegistryError(PipelineError, LookupError):
    """The plugin registry could not give what was asked."""


class UnknownNameError(RegistryError):
    """No component of ``kind`` is registered as ``name``; ``available`` lists those that are."""

    def __init__(self, kind: str, name: str, available: Iterable[str]) -> None:
        self.kind = kind
        self.name = name
        self.available = tuple(sorted(available))
        self.suggestion = closest(name, self.available)
        listed = ", ".join(self.available) or "(none)"
        hint = f" (did you mean {self.suggestion!r}?)" if self.suggestion else ""
        super().__init__(f"no {kind} named {name!r}{hint}; registered {plural(kind)}: {listed}")


def plural(noun: str) -> str:
    """``noun``'s plural, for the nouns messages name (``strategy`` → ``strategies``)."""
    if noun.endswith("y") and noun[-2:-1] not in ("a", "e", "o", "u"):
        return noun[:-1] + "ies"
    return noun + ("es" if noun.endswith(("s", "x", "ch", "sh")) else "s")


class PluginLoadError(RegistryError):
    """Plugin ``plugin`` raised while being imported or asked for its components."""

    def __init__(self, plugin: str, cause: BaseException) -> None:
        self.plugin = plugin
        self.cause = cause
        super().__init__(f"plugin {plugin!r} failed to load: {cause!r}")


class ArtifactError(PipelineError):
    """A model artifact (template, tokenizer, weights, config) is missing or unusable."""


class TemplateError(ArtifactError):
    """The chat template raised or could not be compiled."""


class TokenizerError(ArtifactError):
    """Tokenizer files are missing, unreadable or inconsistent."""


class BackendError(PipelineError):
    """The model backend failed; the requests involved end in state ``failed``."""


class SlotError(BackendError):
    """A backend failure confined to ``slots``; other rows of the same call are unharmed.

    A backend raises this from ``forward`` (or ``truncate``) when it knows which slots are at
    fault and that the other rows' caches were left as they were. Any other exception fails
    every request in the call.
    """

    def __init__(self, slots: Sequence[int], cause: BaseException | str) -> None:
        self.slots = tuple(slots)
        self.cause = cause
        super().__init__(f"backend failed for slots {list(self.slots)}: {cause!r}")


class CapacityError(BackendError):
    """No free slot or cache room; the engine keeps the request queued."""


class OutOfBlocks(CapacityError):
    """A :class:`~pipeline.engine.blocks.BlockManager` has fewer free or evictable KV blocks than
    ``needed`` (``available`` are); nothing was allocated, so the engine may preempt a
    sequence and retry."""

    def __init__(self, needed: int, available: int) -> None:
        self.needed = needed
        self.available = available
        super().__init__(f"out of KV blocks: {needed} needed, {available} free or evictable")


class RequestError(PipelineError):
    """A request did not complete normally; raised from ``RequestHandle.result()``."""

    def __init__(self, request_id: str, message: str) -> None:
        self.request_id = request_id
        super().__init__(f"request {request_id}: {message}")


class RequestFailed(RequestError):
    """The request ended in state ``failed``; ``cause`` is what failed it."""

    def __init__(self, request_id: str, cause: str) -> None:
        self.cause = cause
        super().__init__(request_id, f"failed: {cause}")


class RequestCancelled(RequestError):
    """The request ended in state ``cancelled`` (a caller asked for it)."""

    def __init__(self, request_id: str) -> None:
        super().__init__(request_id, "cancelled")


class EngineClosed(PipelineError):
    """The engine was closed, or stopped (its loop died or its step stalled); it accepts no
    new requests. Also what a request failed with the engine as a whole is raised as over
    HTTP: a 503 the client may retry."""


class DeviceFault(PipelineError):
    """The device failed in a way that leaves it unusable (a CUDA error such as an illegal
    memory access or a device-side assert, which poisons the process's device context): the
    engine stops instead of failing request after request, and an engine in a child process
    is replaced by a fresh process with a fresh context (:mod:`pipeline.runtime.parent`)."""


class StepStillRunning(EngineClosed):
    """An abandoned engine's stalled step has not returned: a fresh engine over the same
    backend cannot start yet."""


class InvariantViolation(PipelineError):
    """Traces checked live (``pipeline.trace.live.CheckingSink``) broke invariants; ``reports``
    holds each failing trace's report."""

    def __init__(self, reports: Sequence[object], rendered: Sequence[str]) -> None:
        self.reports = tuple(reports)
        super().__init__(f"{len(self.reports)} trace(s) broke an invariant:\n"
                         + "\n".join(rendered))


_DEVICE_FAULTS = ("CUDA error", "device-side assert", "illegal memory access",
                  "unspecified launch failure", "CUBLAS_STATUS_EXECUTION_FAILED")


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is the device (or the host) running out of memory: a step's failure,
    not the device's (the next step may fit)."""
    torch = sys.modules.get("torch")  # a torch error comes from a loaded torch
    oom = torch.cuda.OutOfMemoryError if torch is not None else ()
    return isinstance(exc, oom) or "out of memory" in str(exc)


def device_fault(exc: BaseException) -> bool:
    """Whether ``exc`` says the device is unusable (:class:`~pipeline.errors.DeviceFault`):
    torch's ``AcceleratorError``, or a runtime error naming a CUDA fault. Running out of device
    memory is not one (the next step may fit). A backend may raise ``DeviceFault`` itself (a
    parallel group that lost a rank)."""
    if isinstance(exc, DeviceFault):
        return True
    if out_of_memory(exc):
        return False
    accelerator = getattr(sys.modules.get("torch"), "AcceleratorError", None)
    if accelerator is not None and isinstance(exc, accelerator):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _DEVICE_FAULTS)
