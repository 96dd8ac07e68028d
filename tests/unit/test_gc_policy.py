"""The serving GC policy still frees cycles: young collections are rare, so a timer runs full ones."""

from __future__ import annotations

import gc
import threading
import weakref

from fsm_pd.runtime.gc_policy import freeze_survivors, start_full_collections


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


def test_freeze_survivors_frees_cycles_and_takes_what_lives_out_of_the_full_passes():
    freed = threading.Event()
    garbage = _Cyclic()
    garbage.me = garbage
    weakref.finalize(garbage, freed.set)
    del garbage
    survivors = [_Cyclic() for _ in range(500)]  # a node's programs and caches, made after start-up's freeze
    ids = {id(x) for x in survivors}
    try:
        assert sum(id(o) in ids for o in gc.get_objects()) == len(survivors)
        assert freeze_survivors() >= len(survivors)
        assert freed.is_set(), "the cycle was frozen instead of freed"
        # a full collection walks only the generations: the frozen survivors are in none of them
        assert not any(id(o) in ids for o in gc.get_objects())
    finally:
        gc.unfreeze()
