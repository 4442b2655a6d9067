"""Engine supervision: a stopped engine replaced, a stalled one abandoned, idle memory returned.

Owns :class:`Supervisor`. When a model's engine loop stops after an internal error, the model
answers 503 (its queued requests already failed) and a fresh engine replaces it
``restart_delay_s`` later. A watchdog thread checks every engine's ``stall()``: a step in
progress, or an engine process unheard between steps
(:class:`~pipeline.runtime.parent.Unresponsive`: frozen, or not taking up its work), that has
lasted longer than ``stall_timeout_s`` is abandoned (:meth:`~pipeline.engine.api.EngineAPI.abandon`:
its requests fail with a 503, the model is ``restarting``), and the fresh engine starts once
the stuck step has returned (an engine process is killed instead). Once the engines fall idle
after work, free memory is handed back (``release_idle_memory``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Mapping

from pipeline.runtime.parent import ProcessEngine
from pipeline.errors import PipelineError, StepStillRunning
from transports.http.serving_errors import failure_class
from pipeline.process_memory import release_free_memory
from transports.http.gateway.models import UNMENDABLE, ModelState, ServedModel
from transports.http.server.config import ServerConfig

log = logging.getLogger("pipeline.serve")


class Supervisor:
    """Watches the served models' engines until :meth:`stop`."""

    def __init__(self, config: ServerConfig, models: Mapping[str, ServedModel]) -> None:
        self.config = config
        self.models = models
        self.closed = threading.Event()
        self.lifecycle = threading.Lock()  # orders engine restarts against stop()
        self._steps_seen: dict[str, int] = {}
        self._watchdog = threading.Thread(target=self._watch, daemon=True,
                                          name="engine-watchdog")
        self._watchdog.start()

    def stop(self) -> None:
        """No restart starts after this returns; the watchdog ends."""
        with self.lifecycle:
            self.closed.set()

    def supervise(self, served: ServedModel) -> None:
        """Have ``served``'s engine report a stopped loop to :meth:`_engine_stopped`."""
        engine = served.pipeline.engine if served.pipeline is not None else None
        if engine is not None:
            engine.on_stop = lambda why: self._engine_stopped(served, why)

    def _engine_stopped(self, served: ServedModel, why: str) -> None:
        """On the dying engine thread: schedule a fresh engine (503 until it runs), or, when
        none can replace it (:attr:`ServedModel.mendable`), mark the model failed at once."""
        served.stopped_at = time.monotonic()
        if not served.mendable:
            served.error, served.error_class = f"{why}; {UNMENDABLE}", failure_class(why)
            served.state = ModelState.FAILED
            log.error("model %r: the engine loop stopped (%s); %s", served.name, why,
                      UNMENDABLE)
            return
        log.error("model %r: the engine loop stopped (%s); a fresh engine starts in %.1f s",
                  served.name, why, self.config.restart_delay_s)
        if self.closed.is_set():
            return
        timer = threading.Timer(self.config.restart_delay_s, self._restart, (served,))
        timer.daemon = True
        timer.start()

    def _watch(self) -> None:
        """The watchdog thread, until :meth:`stop`: a few looks per ``stall_timeout_s`` (at
        least one a second) for stalls, and free memory handed back once the engines fall
        idle after work."""
        limit = self.config.stall_timeout_s
        while not self.closed.wait(min(limit / 4, 1.0) if limit is not None else 1.0):
            try:
                self.check_stalls()
                if self.config.release_idle_memory and self._fell_idle():
                    release_free_memory()
                    self.release_in_children()
            except Exception:  # the watchdog must outlive a bug in one look
                log.exception("the engine watchdog's check failed")

    def release_in_children(self) -> None:
        """Have each engine process hand its free pages back too (on its engine thread,
        between steps; its answer is not waited for)."""
        for served in self.models.values():
            engine = served.pipeline.engine if served.pipeline is not None else None
            if isinstance(engine, ProcessEngine) and engine.alive:
                with contextlib.suppress(PipelineError):  # stopped or busy: next time
                    engine.call(release_free_memory)

    def _fell_idle(self) -> bool:
        """True when every engine is idle and some stepped since the last look that was."""
        engines = {name: m.pipeline.engine for name, m in self.models.items()
                   if m.pipeline is not None and m.pipeline.engine is not None}
        if any(e.active_slots or e.queue_depth for e in engines.values()):
            return False
        steps = {name: e.steps for name, e in engines.items()}
        moved = steps != self._steps_seen
        self._steps_seen = steps
        return moved

    def check_stalls(self) -> list[str]:
        """Abandon every engine whose stall (a step in progress, an engine process gone
        quiet) has lasted past ``stall_timeout_s``; returns the served names abandoned (the
        watchdog calls this; so may a test)."""
        limit, abandoned = self.config.stall_timeout_s, []
        for served in self.models.values():
            engine = served.pipeline.engine if served.pipeline is not None else None
            stall = engine.stall() if engine is not None and engine.alive else None
            if engine is None or stall is None or limit is None or stall.running_s <= limit:
                continue
            log.error("model %r: the engine stalled: %s (limit %.1f s); its requests fail and "
                      "a fresh engine starts once the old one lets go", served.name,
                      stall.describe_for_log(), limit)
            engine.abandon(f"stalled: {stall.describe()}")
            abandoned.append(served.name)
        return abandoned

    def _restart(self, served: ServedModel) -> None:
        with self.lifecycle:  # never after close(): a fresh engine nobody would close
            if self.closed.is_set() or served.pipeline is None:
                return
            try:
                start = time.perf_counter()
                served.pipeline.restart_engine()
                served.start_s = time.perf_counter() - start
            except StepStillRunning as exc:  # a stalled step holds the backend: wait for it
                log.warning("model %r: %s; trying again in %.1f s", served.name, exc,
                            max(self.config.restart_delay_s, 1.0))
                timer = threading.Timer(max(self.config.restart_delay_s, 1.0), self._restart,
                                        (served,))
                timer.daemon = True
                timer.start()
                return
            except Exception as exc:
                served.error = f"restarting the engine failed: {exc!r}"
                served.state = ModelState.FAILED
                log.exception("model %r: restarting the engine failed", served.name)
                return
        served.restarts += 1
        log.warning("model %r: a fresh engine is running (restart %d)", served.name,
                    served.restarts)
