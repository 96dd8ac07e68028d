"""The process's garbage-collector policy for a serving node.

The node loop allocates several short-lived containers per event (payload dicts, journal rows, decisions); reference
counting frees nearly all of them. With CPython's default thresholds the cyclic collector still runs a young
generation pass every 700 allocations and keeps rescanning everything in flight (rooms, their contexts, pending
timers), which costs about a quarter of the control plane's throughput. Servers therefore freeze what start-up
allocated (it lives forever) and run young collections 50x less often; cycles are still collected.

But with young collections that rare, a full collection becomes very rare too (it waits for 2000 young ones): the
requests in flight at each young collection are promoted, and the cycles they leave once they end (exception
tracebacks, HTTP client objects, asyncio tasks) wait in the older generations for tens of thousands of requests.
Over a soak that reads as a leak of a few tenths of a KB per request (issue 11). So a daemon thread also collects
every generation every ``FULL_COLLECTION_EVERY_S`` seconds: garbage stays bounded by what that many seconds make,
for a pass over the unfrozen heap of a few tens of milliseconds.

The heap a node makes after that first freeze is not small: the warm-up's and the background compile's programs
(executables, their lowered modules, jit's caches) live as long as the node and are unfrozen, and a full pass over
them held the interpreter's lock for 85 to 290 ms on the tiny model (2 shared cores), every ``FULL_COLLECTION_EVERY_S``:
every stream's token stalled that long. So a node freezes again what lives once it is ready and once its background
compile is done (``freeze_survivors``); the full passes then walk only what requests made since.
"""

from __future__ import annotations

import gc
import logging
import threading
import time

SERVING_THRESHOLDS = (35_000, 20, 100)
FULL_COLLECTION_EVERY_S = 10.0

log = logging.getLogger(__name__)


def apply_serving_gc_policy() -> tuple[int, int, int]:
    """Freeze start-up objects and raise the collection thresholds; returns the previous thresholds."""
    previous = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(*SERVING_THRESHOLDS)
    start_full_collections(FULL_COLLECTION_EVERY_S)
    return previous


def freeze_survivors() -> int:
    """Collect every generation, then freeze what survived (it lives as long as the process: programs, caches), so
    that later full collections skip it; returns how many objects were frozen. What requests hold at that moment is
    frozen too: a cycle among those is never freed, a bounded one-time cost."""
    gc.collect()
    before = gc.get_freeze_count()
    gc.freeze()
    frozen = gc.get_freeze_count() - before
    log.debug("froze %d objects that survived a full collection", frozen)
    return frozen


def start_full_collections(every_s: float) -> threading.Event:
    """Collect every generation every ``every_s`` seconds on a daemon thread; set the returned event to stop."""
    if not every_s > 0:
        raise ValueError(f"every_s must be positive, got {every_s!r}")
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(every_s):
            started = time.perf_counter()
            freed = gc.collect()
            log.debug("full collection: %d objects freed in %.1f ms", freed, (time.perf_counter() - started) * 1e3)

    threading.Thread(target=run, name="gc-full", daemon=True).start()
    return stop
