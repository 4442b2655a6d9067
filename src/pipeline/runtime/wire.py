"""What crosses between this process and the engine process (:mod:`pipeline.runtime.parent`,
:mod:`pipeline.runtime.child`).

Owns :class:`EngineRecipe` (what the child builds), :class:`Facts` and :class:`RemoteBackend`
(the child's backend's figures, and their face here), the layout of the shared figures file,
and the pickling both sides use.

**Wire.** One socket pair of messages pickled by value (:func:`dumps`: a tensor travels as
its data). To the child, ``(kind, key, payload)``: ``submit`` (the
:class:`~pipeline.engine.job_spec.JobSpec`, plain data, and the trace so far), ``cancel``,
``call`` (:meth:`~pipeline.runtime.parent.ProcessEngine.call`'s function; a
:class:`RemoteBackend` inside it arrives as the child's real backend), ``uncall`` (a call cancelled before it ran) and ``close``. From the
child, after ``("ready", facts)`` or ``("failed", reason)``: ``(kind, key, extra, payload)``,
``delta``, ``done`` (with the request's final state), ``result`` (``ok`` or ``error``) and
``stopped`` (why its engine loop died). ``key`` is this process's number for the request or
call, never the caller's request id (two requests may share one). A payload is pickled on its
own, so one that cannot be read fails its request or call alone; the child's exceptions come
back whole (:class:`~pipeline.errors.PipelineError` pickles; others become a
:class:`~pipeline.errors.BackendError` naming them). Messages to the child are pickled on the
caller's thread (what cannot cross is an :class:`~pipeline.errors.InvalidValueError` there)
and written by a writer thread, so no caller — an event loop cancelling a request, ``close`` —
ever blocks on a frozen child.
"""

from __future__ import annotations

import pickle
import signal
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from pipeline.errors import BackendError, InvalidValueError
from pipeline.options import BackendOptions
from pipeline.contracts.model import ModelCall, ModelInfo, Tap

STEPS, STARTED, ACTIVE, QUEUED, BEAT, TAKEN = range(6)
"""The liveness figures' places in the file both processes map (see
:mod:`pipeline.runtime.parent`)."""
FIGURES_SIZE = 8 * 6
SERVED: dict[str, Any] = {}
"""In the child: its real backend (``"backend"``), what a pickled :class:`RemoteBackend`
becomes."""


@attrs.frozen
class EngineRecipe:
    """What the child builds: ``build(model, options=options, **build_args)`` (``model``
    None: the default model), after running ``setup``. Pickled to the child."""

    model: str | Path | None
    options: BackendOptions = attrs.field(factory=BackendOptions)
    build_args: dict[str, Any] = attrs.field(factory=dict)
    setup: tuple[Callable[[], Any], ...] = ()
    """Run in the child before it builds (module-level functions: the server's caps on native
    memory caches, say, which are per process)."""
    ranks: int = attrs.field(default=1)
    """More than 1: the child is rank 0 of a parallel group of that many processes, the
    others started and watched beside it (:mod:`pipeline.runtime.ranks`)."""

    @ranks.validator
    def _ranks(self, _: attrs.Attribute[int], value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidValueError("ranks", value, "must be a whole number of processes, 1 "
                                    "or more")


@attrs.frozen
class Facts:
    """The child's backend's figures, sent once it is loaded."""

    vocab_size: int
    num_slots: int
    max_context: int
    snapshot: str
    batch_invariant: bool | None
    info: ModelInfo | None
    hidden_size: int | None
    pid: int
    tap_names: tuple[str, ...] | None = None
    """The child's backend's layer taps (None: it has none)."""


class RemoteBackend:
    """The backend's face in the parent: its figures (``vocab_size``, ``num_slots``,
    ``max_context``, ``snapshot``, ``batch_invariant``) and nothing that runs the model, which
    is in the child. Pickled (inside a
    :meth:`~pipeline.runtime.parent.ProcessEngine.call`'s function), it arrives in
    the child as the real backend. :func:`remote_backend` adds what the child's backend can
    say: ``model_info()``, ``tap_names()`` (its layer taps: a ``taps`` request is recorded in
    the child), and, for an embedding model, ``hidden_size`` and ``hidden_states``
    (computed in the child through :meth:`~pipeline.runtime.parent.ProcessEngine.call`)."""

    def __init__(self, facts: Facts) -> None:
        self.vocab_size, self.num_slots = facts.vocab_size, facts.num_slots
        self.max_context, self.snapshot = facts.max_context, facts.snapshot
        self.batch_invariant = facts.batch_invariant
        self.thread_policy = facts.info.threads if facts.info is not None else None
        self.facts = facts

    def __reduce__(self) -> tuple[Callable[[], Any], tuple[()]]:
        return child_backend, ()

    def _elsewhere(self, *_: Any) -> Any:
        raise BackendError("the model runs in the engine process: this backend only answers "
                           "its figures")

    allocate = release = cache_length = truncate = _elsewhere

    def forward(self, calls: Sequence[ModelCall]) -> torch.Tensor:
        return self._elsewhere(calls)  # type: ignore[no-any-return]


class _Describes(RemoteBackend):
    def model_info(self) -> ModelInfo:
        """What the child's backend said about its model."""
        assert self.facts.info is not None
        return self.facts.info


class _Taps(RemoteBackend):
    def tap_names(self) -> tuple[str, ...]:
        """The child's backend's layer taps (a ``taps`` request is recorded there)."""
        assert self.facts.tap_names is not None
        return self.facts.tap_names

    def set_tap(self, tap: Tap | None) -> None:
        self._elsewhere(tap)


class _Embeds(RemoteBackend):
    def __init__(self, facts: Facts) -> None:
        super().__init__(facts)
        assert facts.hidden_size is not None
        self.hidden_size = facts.hidden_size

    def hidden_states(self, token_ids: Sequence[int]) -> torch.Tensor:
        return self._elsewhere(token_ids)  # type: ignore[no-any-return]


def remote_backend(facts: Facts) -> RemoteBackend:
    """A :class:`RemoteBackend` with the optional capabilities the child's backend has."""
    bases: tuple[type[RemoteBackend], ...] = tuple(
        base for base, has in ((_Embeds, facts.hidden_size is not None),
                               (_Describes, facts.info is not None),
                               (_Taps, facts.tap_names is not None)) if has)
    if not bases:
        return RemoteBackend(facts)
    made: type[RemoteBackend] = type("RemoteBackend", bases, {})
    return made(facts)


def child_backend() -> Any:
    """The child's real backend (what a pickled :class:`RemoteBackend` becomes)."""
    return SERVED["backend"]


def dumps(message: Any) -> bytes:
    """``message`` pickled by value (plain :mod:`pickle`: a tensor travels as its data, never
    as a handle to shared memory the other process could not open)."""
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> Any:
    return pickle.loads(data)


def portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives a pickle round trip, else a :class:`BackendError` saying what
    it was (an exception whose constructor takes other arguments than its message)."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return BackendError(f"{type(exc).__name__}: {exc}")


def exit_words(code: int | None) -> str:
    """How a child process ended, in words."""
    if code is None:
        return "did not end"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        why = " (by hand, or by the out-of-memory killer)" if -code == signal.SIGKILL else ""
        return f"was killed by {name}{why}"
    return f"exited with status {code}"
