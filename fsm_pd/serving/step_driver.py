"""Runs a scheduler's ``step`` on the model thread for as long as it has work, and never twice at once.

The scheduler does not get a thread of its own: its steps are jobs on the model thread's FIFO queue, so the KV
manager's gathers, scatters and page frees run between two steps, in the order they were asked for, and nothing
else ever touches the pool. ``kick()`` (any thread) makes sure one step is queued; a step that returns True queues
the next one. A kick that lands while a step runs queues another step after it, so no wake-up is lost. A driver
starts held: kicks before ``start()`` (a KV manager recovering rooms while its engine is still being built) are kept
and run once the engine is whole.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from fsm_pd.model.model_thread import ModelThread

log = logging.getLogger(__name__)


class StepDriver:
    def __init__(self, model_thread: ModelThread, step: Callable[[], bool], name: str = "scheduler"):
        self._model_thread = model_thread
        self._step = step
        self._name = name
        self._lock = threading.Lock()
        self._queued = False
        self._closed = False
        self._held, self._kicked_while_held = True, False
        self.steps = 0

    def start(self) -> None:
        """Let steps run; one runs now if anything kicked before."""
        with self._lock:
            self._held = False
            kicked = self._kicked_while_held
        if kicked:
            self.kick()

    def kick(self) -> None:
        with self._lock:
            if self._held:
                self._kicked_while_held = True
                return
            if self._queued or self._closed:
                return
            self._queued = True
        try:
            self._model_thread.submit(self._run)
        except RuntimeError:  # the model thread was shut down under us: the engine is closing
            with self._lock:
                self._queued = False

    def _run(self, _owner: ModelThread) -> None:
        with self._lock:
            self._queued = False
        self.steps += 1
        try:
            more = self._step()
        except Exception:  # the scheduler fails its own requests; this only keeps the driver alive
            log.exception("%s step failed", self._name)
            more = False
        if more:
            self.kick()

    def close(self) -> None:
        with self._lock:
            self._closed = True
