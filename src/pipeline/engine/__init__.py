"""The engine: one autoregressive step over every request of a pipeline, over its backend's
slots and KV blocks, one batched forward per step (docs/design.md §6; the step, walked through,
is docs/engine_step.md). What drives the step — a thread, or a child process — and watches it
is :mod:`pipeline.runtime`'s.

The package's modules, in the order a request meets them:

=================  ==========================================================================
``handle``         :class:`RequestHandle`, what the caller holds (deltas, result, cancel): the
                   only object shared between the caller's thread and the engine's
``job_spec``       :class:`~pipeline.engine.job_spec.JobSpec`, a request's plain-data spec
                   (what :class:`~pipeline.pipe.Pipeline` prepared on the caller's thread)
``job``            :class:`~pipeline.engine.job.Job`, a request in flight: its spec, decode
                   state, recorder, text state and handle (it pushes the deltas)
``loop``           :class:`Engine` and :class:`EngineConfig`: the queue, the active list and
                   the step (settle → admit → plan → forward → commit)
``pacing``         the pacer that sizes a step's prefill beside decoding requests
``blocks``         the KV block manager and the content-addressed prefix cache
``paging``         the one KV memory interface: the rules over a paged backend (admission by
                   free blocks, growth, preemption by recompute, publication, release), and
                   the trivial adapter for a backend that keeps its own memory
``commit``         :class:`~pipeline.engine.commit.Committer`: a step's logits through each
                   request's strategy into tokens, stops, text and deltas
``text_state``     a request's detokenizer, stoppers and typed output parts between steps
``recorder``       a request's trace events, in causal order
``api``            :class:`~pipeline.engine.api.EngineAPI`, what a pipeline and a supervisor
                   use of an engine (:mod:`pipeline.runtime` provides it), and the records
                   it names
=================  ==========================================================================

Importing ``pipeline.engine`` gives the names a caller of the engine uses (:class:`Engine`,
:class:`EngineConfig`, :class:`RequestHandle`, :data:`ENGINE_DOWN`, :data:`MAX_CALLS`); the
rest is importable from its module.
"""

from __future__ import annotations

from pipeline.engine.api import ENGINE_DOWN, MAX_CALLS, Stall, StrategyFactory
from pipeline.engine.handle import RequestHandle, RequestState
from pipeline.engine.loop import Engine, EngineConfig

__all__ = ["ENGINE_DOWN", "MAX_CALLS", "Engine", "EngineConfig", "RequestHandle",
           "RequestState", "Stall", "StrategyFactory"]
