"""Running effects: the node loop, effect interpreters, timers and clocks.

The names below load their modules on first use (PEP 562): the node loop brings the journal (SQLAlchemy, 0.3 s of a
start), which a colocated node, importing only the checksum outcomes' names from here, does without.
"""

from __future__ import annotations

import importlib

_HOME = {
    "EffectError": "interpreter",
    "EffectInterpreter": "interpreter",
    "Node": "node",
    "RealClock": "clock",
    "RecordingInterpreter": "interpreter",
    "VirtualClock": "clock",
}
__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    globals()[name] = value  # the next lookup finds it without this hook
    return value
