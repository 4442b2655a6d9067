"""How the engine runs, and its supervision: the layer above the step (:mod:`pipeline.engine`).

The engine package is one autoregressive step; this package drives it and watches it. Both
classes here provide :class:`~pipeline.engine.api.EngineAPI`, which is all a
:class:`~pipeline.pipe.Pipeline` and the HTTP gateway's supervision use of an engine.

=================  ==========================================================================
``thread``         :class:`~pipeline.runtime.thread.ThreadEngine`: the step driven by a thread
                   of this process; the submissions and the call queue, stalls, abandon, a
                   loop that dies, fresh engines, closing at exit (what ``build()`` gives)
``parent``         :class:`~pipeline.runtime.parent.ProcessEngine`: the engine in a child
                   process, started and watched from this one (liveness, deadlines, death)
``child``          the child process's side: builds the recipe's pipeline, serves the parent
``wire``           what crosses between them: the recipe, the backend's figures, the pickling
``ranks``          the other ranks of a parallel group whose rank 0 is the engine process
=================  ==========================================================================

``thread`` needs only the engine; the process engine's ``parent`` and ``child`` build whole
pipelines (:func:`pipeline.builder.build`), the engine itself never does.
"""
