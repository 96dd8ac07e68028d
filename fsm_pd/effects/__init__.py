"""Running effects: the node loop, effect interpreters, timers and clocks.

The names below load their modules on first use (PEP 562): the node loop brings the journal (SQLAlchemy, 0.3 s of a
start), which a colocated node, importing only the checksum outcomes' names from here, does without.
"""

from __future__ import annotations

from fsm_pd.runtime.lazy import lazy_exports

_HOME = {
    "EffectError": "interpreter",
    "EffectInterpreter": "interpreter",
    "Node": "node",
    "RealClock": "clock",
    "RecordingInterpreter": "interpreter",
    "VirtualClock": "clock",
}
__all__, __getattr__ = lazy_exports(__name__, _HOME)
