"""Brief turns of the interpreter's lock while a serving process compiles beside the model thread.

The model thread lets go of the interpreter's lock at every wait on the device and needs it back to go on. A thread
that runs Python without pause (a background compile tracing and lowering a program: seconds of it) keeps the lock
until the interpreter takes it away, every ``sys.getswitchinterval()`` (5 ms by default). So every time the model
thread wants the lock back it waits up to 5 ms: a tiny-model decode step of 8 rows took 18.1 ms instead of 4.3 with a
thread tracing beside it, and 7.5 ms with 0.5 ms turns (``bench/compile_beside.py``, medians of 5 rounds on a shared
2-core machine). Under a serving load alone (the event loop, which lets go of the lock at every socket write) shorter
turns gained nothing and cost CPU (tiny model, 16 streams, 3 rounds each way: 3,004 tok/s at 5 ms, 2,499 at 0.5), so
they are kept to the background compile's programs (``brief_turns``).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

BRIEF_TURN_S = 0.0005

_lock = threading.Lock()
_holders = 0
_saved = 0.0


@contextmanager
def brief_turns(turn_s: float = BRIEF_TURN_S) -> Iterator[None]:
    """While inside (any thread, nested or side by side), the lock changes hands every ``turn_s`` at most; the
    interval before the first entry comes back after the last exit."""
    global _holders, _saved
    with _lock:
        if _holders == 0:
            _saved = sys.getswitchinterval()
            sys.setswitchinterval(min(turn_s, _saved))
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0:
                sys.setswitchinterval(_saved)
