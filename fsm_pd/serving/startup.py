"""A node's start-up, phase by phase, and whether it is ready.

A node answers HTTP from its first seconds, so that an orchestrator's probes and a launcher see how far it got; it
takes requests once it is *ready*: it holds the programs any request needs (``warmup.py``), and compiles the rest in
the background. The phases it goes through, each timed from the process's own start:

- ``imports``: jax and the serving code;
- ``weights``: reading the checkpoint (or the converted copy of it, ``model/converted.py``);
- ``engine``: the KV pool, the journal, the sockets;
- ``programs``: the programs it needs before it is ready (``ready_set``), compiled or loaded from the compile cache;
- ``first_request``: from ready to the end of the first request it answered.

``/health`` answers 503 ``{"status": "starting", ...}`` with this progress until the node is ready, so a router
sends nothing to a node that would make a request wait; ``/metrics`` exports the phases as
``fsm_pd_startup_seconds{phase}``. ``docs/operations.md`` maps them to an orchestrator's probes.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client.core import GaugeMetricFamily

log = logging.getLogger(__name__)


def process_started_at() -> float:
    """This process's start, in ``time.time()``'s clock: from /proc on Linux (the interpreter's own start-up counts
    too), else now."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, after the command name
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


class Startup:
    """The start-up timeline of one node, and its readiness. Thread-safe: the start-up thread writes it, the HTTP
    server reads it."""

    def __init__(self, started_at: float | None = None, *, ready: bool = False):
        self.started_at = process_started_at() if started_at is None else started_at
        self._lock = threading.Lock()
        self._phases: dict[str, float] = {}
        # each phase's first start and last end, in seconds since the process started: the phases overlap (threads),
        # and which waited on which shows only on a timeline (a TPU host's imports took 4.5 s on one start, 10.4 on
        # the next, beside the same 8.8 s of the device opening)
        self._spans: dict[str, tuple[float, float]] = {}
        self._current: str | None = None
        self._steps_done = self._steps_total = 0
        self._step_name = ""
        self._steps_started: float | None = None
        self.ready_event = threading.Event()
        self.ready_after: float | None = None
        self.first_request_after: float | None = None
        self.programs: dict[str, dict] = {}  # per kind of program, what it cost before ready (``compiles.costs``)
        self.background: dict | None = None  # once the background compile is done: its programs and seconds
        self.failed: str | None = None
        if ready:
            self.mark_ready()

    def since_start(self) -> float:
        return time.time() - self.started_at

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        began = time.time()
        with self._lock:
            self._current = name
        try:
            yield
        finally:
            with self._lock:
                self._add(name, time.time() - began, began)
                self._current = None

    def record(self, name: str, seconds: float, began: float | None = None) -> None:
        """A phase timed elsewhere (the imports, timed before this object could exist; a thread's work): ``began``
        is when it started (``time.time()``), else it ended just now."""
        with self._lock:
            self._add(name, seconds, time.time() - seconds if began is None else began)

    def _add(self, name: str, seconds: float, began: float) -> None:
        self._phases[name] = self._phases.get(name, 0.0) + seconds
        start, end = began - self.started_at, began - self.started_at + seconds
        first, last = self._spans.get(name, (start, end))
        self._spans[name] = (min(first, start), max(last, end))

    def timeline(self) -> dict[str, tuple[float, float]]:
        """Each phase's ``(start, end)`` in seconds since the process started."""
        with self._lock:
            return {name: (round(a, 2), round(b, 2)) for name, (a, b) in self._spans.items()}

    # --- progress of the programs phase ---
    def steps(self, total: int) -> None:
        with self._lock:
            self._steps_total, self._steps_done, self._steps_started = total, 0, time.time()

    def step(self, name: str, *, done: bool = False) -> None:
        with self._lock:
            self._step_name = name
            self._steps_done += done

    # --- readiness ---
    @property
    def ready(self) -> bool:
        return self.ready_event.is_set()

    def mark_ready(self, programs: dict[str, dict] | None = None) -> None:
        with self._lock:
            if self.ready_after is None:
                self.ready_after = self.since_start()
                self.programs = programs or {}
        self.ready_event.set()

    def mark_failed(self, reason: str) -> None:
        with self._lock:
            self.failed = reason

    def background_done(self, report: dict) -> None:
        """The background compile finished: every program the node runs is compiled (``warmup.compile_rest``)."""
        with self._lock:
            self.background = report

    def request_done(self) -> None:
        """A request was answered; the first one after ready ends the ``first_request`` phase."""
        if self.first_request_after is not None or not self.ready:
            return
        with self._lock:
            if self.first_request_after is None:
                self.first_request_after = self.since_start()
                ready = self.ready_after or 0.0
                self._add("first_request", self.first_request_after - ready, self.started_at + ready)
                log.info("start-up: first request answered %.1f s after the process started", self.first_request_after)

    def status(self) -> dict:
        """What ``/health`` says while the node starts, and ``/server_info`` after: the phases so far, and progress."""
        with self._lock:
            out = {"status": "ready" if self.ready else ("failed" if self.failed else "starting"),
                   "seconds_since_start": round(self.since_start(), 2),
                   "phases": {name: round(s, 3) for name, s in self._phases.items()},
                   "timeline": {name: [round(a, 2), round(b, 2)] for name, (a, b) in self._spans.items()}}
            if self._current:
                out["phase"] = self._current
            if self.failed:
                out["reason"] = self.failed
            if self.ready_after is not None:
                out["ready_after_s"] = round(self.ready_after, 3)
            if self.first_request_after is not None:
                out["first_request_after_s"] = round(self.first_request_after, 3)
            if self.programs:
                out["programs_before_ready"] = self.programs
            if self.ready:
                out["background_compile"] = self.background or "running"
            if self._steps_total and not self.ready:
                out["progress"] = self._progress()
            return out

    def _progress(self) -> dict:
        done, total = self._steps_done, self._steps_total
        elapsed = time.time() - (self._steps_started or time.time())
        left = elapsed / done * (total - done) if done else None
        return {"done": done, "total": total, "step": self._step_name,
                "seconds_left": None if left is None else round(left, 1)}


class StartupCollector:
    """``fsm_pd_startup_seconds{phase}``, and ``ready_after`` as the phase ``ready``, for a Prometheus registry."""

    def __init__(self, startup: Startup):
        self.startup = startup

    def collect(self):
        family = GaugeMetricFamily("fsm_pd_startup_seconds", "Seconds this node spent in each start-up phase "
                                   "(imports, weights, engine, programs, first_request), and from its process's "
                                   "start to ready (phase ready)", labels=["phase"])
        status = self.startup.status()
        for phase, seconds in status["phases"].items():
            family.add_metric([phase], seconds)
        if "ready_after_s" in status:
            family.add_metric(["ready"], status["ready_after_s"])
        yield family
