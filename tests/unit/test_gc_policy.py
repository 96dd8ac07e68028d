"""The serving GC policy still frees cycles: young collections are rare, so a timer runs full ones."""

from __future__ import annotations

import gc
import threading
import weakref

from fsm_pd.runtime.gc_policy import start_full_collections


class _Cyclic:
    pass


def test_cycles_are_freed_although_young_collections_never_run():
    previous = gc.get_threshold()
    gc.set_threshold(10**9)  # no collection on its own: only the timer's
    freed = threading.Event()
    stop = None
    try:
        garbage = _Cyclic()
        garbage.me = garbage  # a reference cycle: reference counting alone never frees it
        weakref.finalize(garbage, freed.set)
        del garbage
        stop = start_full_collections(0.05)
        assert freed.wait(30), "the cycle was never collected"
    finally:
        if stop is not None:
            stop.set()
        gc.set_threshold(*previous)
