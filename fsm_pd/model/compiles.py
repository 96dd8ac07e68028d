"""Counts the XLA programs this process loads, and what each kind of program cost to trace, lower and compile.

Every program a process loads (compiled, or read back from the persistent compile cache) costs seconds on a serving
node and maps new code into it. A node prepares the programs a request needs first before it reports ready, and the
rest on a background thread while it serves (``serving/warmup.py``). So there are three phases:

- ``startup``: before the node is ready;
- ``background``: compiled ahead by the background thread, while the node serves (no request waits on them);
- ``serving``: compiled because a request needed it now. That request, and its batch, waited: it must stay 0.

``/metrics`` exports ``fsm_pd_compiles_total{phase}``, and per kind of program (``preparing``) the seconds spent
tracing, lowering and in the backend, with how many programs came from the compile cache, and how many were loaded
whole as serialized executables (``executables.py``: no trace, lowering or compile; ``loaded``), and
``fsm_pd_executables_refused_total{kind}``: entries of that store found but not loaded, each compiled over
(``refused``).

JAX reports these through ``jax.monitoring`` on the thread that compiles, which is how a kind and a phase set on
that thread (``preparing``) reach the counts. Its listeners are process-wide, so this module is too.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

from prometheus_client.core import CounterMetricFamily

log = logging.getLogger(__name__)
T = TypeVar("T")

# jax._src.dispatch's event names
_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # wraps the persistent-cache lookup too
_CACHE_HIT = "/jax/compilation_cache/cache_hits"

PHASES = ("startup", "background", "serving")

_lock = threading.Lock()
_counts = dict.fromkeys(PHASES, 0)
_phase = "startup"
_installed = False
# .kind, .phase: set by ``preparing``; .hit: the program being compiled came from cache; .fresh: XLA compiled the last
_local = threading.local()
late: deque[str] = deque(maxlen=64)  # the names of the last programs compiled while serving


@dataclass
class KindCost:
    """What the programs of one kind cost this process: counts and seconds."""

    programs: int = 0
    from_cache: int = 0
    trace_s: float = 0.0
    lower_s: float = 0.0
    backend_s: float = 0.0  # XLA's compile, or the compile cache's load
    from_executable: int = 0  # loaded as serialized executables (``executables.py``), counted in ``programs``
    load_s: float = 0.0  # reading and loading those
    refused: int = 0  # entries of the executable store found but not loaded (``executables.py``): compiled over

    @property
    def seconds(self) -> float:
        return self.trace_s + self.lower_s + self.backend_s + self.load_s


_kinds: dict[str, KindCost] = {}


def install() -> None:
    """Start counting (idempotent). Imported lazily: jax is heavy."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    jax.monitoring.register_event_listener(lambda event, **_: _on_event(event))


def _on_event(event: str) -> None:
    if event == _CACHE_HIT:
        _local.hit = True


def _on_duration(event: str, seconds: float, fun_name: str = "?", **_) -> None:
    if event not in (_TRACE, _LOWER, _BACKEND_COMPILE):
        return
    kind = getattr(_local, "kind", None) or "other"
    with _lock:
        cost = _kinds.setdefault(kind, KindCost())
        if event == _TRACE:
            cost.trace_s += seconds
            return
        if event == _LOWER:
            cost.lower_s += seconds
            return
        cost.backend_s += seconds
        cost.programs += 1
        cost.from_cache += bool(getattr(_local, "hit", False))
        _local.fresh, _local.hit = not getattr(_local, "hit", False), False
        phase = getattr(_local, "phase", None) or _phase
        _counts[phase] += 1
        if phase == "serving":
            late.append(fun_name)
    if phase == "serving":  # a shape nobody prepared (or warm-up was skipped): say which, it stalled a request
        log.warning("compiled %s while serving (%.2f s)", fun_name, seconds)


def loaded(seconds: float) -> None:
    """A program of this thread's kind was loaded as a serialized executable in ``seconds``: JAX reports nothing for
    it, so it is counted here, in the phase it would have compiled in."""
    kind = getattr(_local, "kind", None) or "other"
    with _lock:
        cost = _kinds.setdefault(kind, KindCost())
        cost.programs += 1
        cost.from_executable += 1
        cost.load_s += seconds
        _counts[getattr(_local, "phase", None) or _phase] += 1


def refused() -> None:
    """An entry of the executable store was found for a program of this thread's kind but not loaded: the program is
    compiled over (``executables.py`` says why in its log)."""
    kind = getattr(_local, "kind", None) or "other"
    with _lock:
        _kinds.setdefault(kind, KindCost()).refused += 1


def compiled_here(compile: Callable[[], T]) -> tuple[T, bool]:
    """``compile()``'s program, and whether XLA compiled it in this call: not when JAX's compile cache loaded it,
    nor when jit's own memory handed back one compiled or loaded before (JAX reports nothing then). Counting is
    installed first: JAX reports a compile through ``jax.monitoring``, on the compiling thread."""
    install()
    _local.fresh = False
    program = compile()
    return program, _local.fresh


@contextmanager
def preparing(kind: str, *, background: bool = False) -> Iterator[None]:
    """Attribute the programs this thread loads inside to ``kind``, and with ``background`` to the background phase
    (the node serves meanwhile, and no request waits on them)."""
    saved = getattr(_local, "kind", None), getattr(_local, "phase", None)
    _local.kind, _local.phase = kind, ("background" if background else saved[1])
    try:
        yield
    finally:
        _local.kind, _local.phase = saved


def serving() -> None:
    """Start-up is over: programs loaded from now on count as ``serving`` (unless prepared in the background)."""
    global _phase
    with _lock:
        _phase = "serving"


def counts() -> dict[str, int]:
    with _lock:
        return dict(_counts)


def costs() -> dict[str, KindCost]:
    """Per kind of program, what this process spent on it so far."""
    with _lock:
        return {kind: KindCost(**vars(cost)) for kind, cost in _kinds.items()}


class CompileCollector:
    """``fsm_pd_compiles_total{phase}`` and the per-kind costs, for a Prometheus registry."""

    def collect(self):
        family = CounterMetricFamily("fsm_pd_compiles", "XLA programs this process compiled or loaded from the "
                                     "compile cache: before it was ready (startup), ahead of need while it served "
                                     "(background), and because a request needed one now (serving)",
                                     labels=["phase"])
        for phase, count in counts().items():
            family.add_metric([phase], count)
        yield family
        seconds = CounterMetricFamily("fsm_pd_program_prepare_seconds", "Seconds this process spent preparing "
                                      "programs, per kind and step (trace, lower, backend: XLA's compile or the "
                                      "compile cache's load; load: a serialized executable's)", labels=["kind", "step"])
        programs = CounterMetricFamily("fsm_pd_programs", "Programs this process prepared, per kind and source "
                                       "(compiled, loaded from the compile cache, or loaded as a serialized "
                                       "executable)",
                                       labels=["kind", "source"])
        refusals = CounterMetricFamily("fsm_pd_executables_refused", "Entries of the executable store this process "
                                      "found but did not load (damaged, another program's, or unable to run), per "
                                      "kind: each was compiled over", labels=["kind"])
        for kind, cost in costs().items():
            for step in ("trace", "lower", "backend", "load"):
                seconds.add_metric([kind, step], getattr(cost, f"{step}_s"))
            programs.add_metric([kind, "cache"], cost.from_cache)
            programs.add_metric([kind, "executable"], cost.from_executable)
            programs.add_metric([kind, "compiled"], cost.programs - cost.from_cache - cost.from_executable)
            refusals.add_metric([kind], cost.refused)
        yield seconds
        yield programs
        yield refusals
