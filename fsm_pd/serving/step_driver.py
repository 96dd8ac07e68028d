"""Runs a scheduler's ``step`` on the model thread for as long as it has work, and never twice at once.

The scheduler does not get a thread of its own: its steps are jobs on the model thread's FIFO queue, so the KV
manager's gathers, scatters and page frees run between two steps, in the order they were asked for, and nothing
else ever touches the pool. ``kick()`` (any thread) makes sure one step is queued; a step that returns True queues
the next one. A kick that lands while a step runs queues another step after it, so no wake-up is lost. A driver
starts held: kicks before ``start()`` (a KV manager recovering rooms while its engine is still being built) are kept
and run once the engine is whole.

It times its steps (``timing``, ``/server_info``'s ``step_loop``): how long they ran, and the gaps between them,
split by what the step before had said. After a step that asked for the next one, the gap is how long that step
waited behind the model thread's other jobs (the KV manager's gathers, scatters and page frees, a warm-up's kernels);
after one that had nothing left, the thread was idle until a kick. A scheduler losing to another with the same step
costs shows where (``bench/load.py``'s step-loop table; docs/tpu.md, seventeenth round).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from fsm_pd.model.model_thread import ModelThread

log = logging.getLogger(__name__)


class StepDriver:
    def __init__(self, model_thread: ModelThread, step: Callable[[], bool], name: str = "scheduler",
                 clock: Callable[[], float] = time.perf_counter):
        self._model_thread = model_thread
        self._step = step
        self._name = name
        self._clock = clock
        self._lock = threading.Lock()
        self._queued = False
        self._closed = False
        self._held, self._kicked_while_held = True, False
        self.steps = 0
        # the model thread's: the last step's end and whether it asked for more; the sums ``timing`` reads
        self._ended: float | None = None
        self._more = False
        self._busy_s = self._waited_s = self._waited_max_s = self._idle_s = 0.0
        self._waits = 0

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
        began = self._clock()
        if self._ended is not None:
            gap = began - self._ended
            if self._more:
                self._waits += 1
                self._waited_s += gap
                self._waited_max_s = max(self._waited_max_s, gap)
            else:
                self._idle_s += gap
        self.steps += 1
        try:
            more = self._step()
        except Exception:  # the scheduler fails its own requests; this only keeps the driver alive
            log.exception("%s step failed", self._name)
            more = False
        self._ended, self._more = self._clock(), more
        self._busy_s += self._ended - began
        if more:
            self.kick()

    def timing(self) -> dict:
        """Its steps so far: how many, their seconds, and the gaps between them (the module's doc). Any thread:
        sums read without a lock, each a moment apart."""
        return {"steps": self.steps, "busy_s": round(self._busy_s, 6), "waits": self._waits,
                "waited_s": round(self._waited_s, 6), "waited_max_s": round(self._waited_max_s, 6),
                "idle_s": round(self._idle_s, 6)}

    def close(self) -> None:
        with self._lock:
            self._closed = True
