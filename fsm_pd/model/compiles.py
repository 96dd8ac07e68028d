"""Counts the XLA programs this process loads, before and after it started serving.

Every program a process loads (compiled, or read back from the persistent compile cache) costs seconds on a serving
node and maps new code into it. A node compiles what its configuration can form before it serves (``warmup.py``);
after that, the count must stay put. ``/metrics`` exports it as ``fsm_pd_compiles_total{phase=startup|serving}``,
and the benches print it.

JAX times both kinds as one ``jax.monitoring`` duration event (the backend compile event wraps the persistent-cache
lookup too). Its listeners are process-wide, so this module is too.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

from prometheus_client.core import CounterMetricFamily

log = logging.getLogger(__name__)

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch.BACKEND_COMPILE_EVENT

_lock = threading.Lock()
_counts = {"startup": 0, "serving": 0}
_phase = "startup"
_installed = False
late: deque[str] = deque(maxlen=64)  # the names of the last programs compiled while serving


def install() -> None:
    """Start counting (idempotent). Imported lazily: jax is heavy."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, fun_name="?", **_: _count(fun_name, seconds) if event == _BACKEND_COMPILE else None)


def _count(name: str, seconds: float) -> None:
    with _lock:
        _counts[_phase] += 1
        serving = _phase == "serving"
        if serving:
            late.append(name)
    if serving:  # a shape the warm-up missed (or warm-up was skipped): say which, it stalled a request
        log.warning("compiled %s while serving (%.2f s)", name, seconds)


def serving() -> None:
    """Start-up is over: programs loaded from now on count as ``serving``."""
    global _phase
    with _lock:
        _phase = "serving"


def counts() -> dict[str, int]:
    with _lock:
        return dict(_counts)


class CompileCollector:
    """``fsm_pd_compiles_total{phase}`` for a Prometheus registry."""

    def collect(self):
        family = CounterMetricFamily("fsm_pd_compiles", "XLA programs this process compiled or loaded from the "
                                     "compile cache, before it served (startup) and while serving (serving)",
                                     labels=["phase"])
        for phase, count in counts().items():
            family.add_metric([phase], count)
        yield family
