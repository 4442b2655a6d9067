"""The engine: one thread (or one child process) that drives every request of a pipeline over its backend's slots and
KV blocks, one batched forward per step (docs/design.md §6; the step, walked through, is
docs/engine_step.md).

The package's modules, in the order a request meets them:

=================  ==========================================================================
``handle``         :class:`RequestHandle`, what the caller holds (deltas, result, cancel): the
                   only object shared between the caller's thread and the engine's
``job_spec``       :class:`~pipeline.engine.job_spec.JobSpec`, a request's plain-data spec
                   (what :class:`~pipeline.pipe.Pipeline` prepared on the caller's thread)
``job``            :class:`~pipeline.engine.job.Job`, a request in flight: its spec, decode
                   state, text state and tracer
``loop``           :class:`Engine` and :class:`EngineConfig`: the thread, the queue, the step
                   (settle → admit → plan → forward → commit), containment and stalls
``pacing``         the pacer that sizes a step's prefill beside decoding requests
``blocks``         the KV block manager and the content-addressed prefix cache
``paging``         the one KV memory interface: the rules over a paged backend (admission by
                   free blocks, growth, preemption by recompute, publication, release), and
                   the trivial adapter for a backend that keeps its own memory
``commit``         :class:`~pipeline.engine.commit.Committer`: a step's logits through each
                   request's strategy into tokens, stops, text and deltas
``text_state``     a request's detokenizer, stoppers and typed output parts between steps
``api``            :class:`~pipeline.engine.api.EngineAPI`, what a pipeline and a supervisor
                   use of an engine (the thread engine and the process engine provide it)
``process``        :class:`~pipeline.engine.process.ProcessEngine`: a whole engine (model and
                   scheduler) in a child process, watched from this one; its death fails its
                   requests at once, and a fresh process replaces it
=================  ==========================================================================

Importing ``pipeline.engine`` gives the names a caller of the engine uses (:class:`Engine`,
:class:`EngineConfig`, :class:`RequestHandle`, :data:`ENGINE_DOWN`, :data:`MAX_CALLS`); the
rest is importable from its module.
"""

from __future__ import annotations

from pipeline.engine.handle import RequestHandle, RequestState
from pipeline.engine.loop import (
    ENGINE_DOWN, MAX_CALLS, Engine, EngineConfig, Stall, StrategyFactory,
)

__all__ = ["ENGINE_DOWN", "MAX_CALLS", "Engine", "EngineConfig", "RequestHandle",
           "RequestState", "Stall", "StrategyFactory"]
