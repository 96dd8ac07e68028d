"""The process's memory policy for a serving node: the garbage collector's and glibc malloc's.

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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import threading
import time

SERVING_THRESHOLDS = (35_000, 20, 100)
MALLOC_ARENAS = 2
_M_ARENA_MAX = -8  # glibc's mallopt parameter (malloc.h)
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


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """Cap glibc's malloc arenas (as ``MALLOC_ARENA_MAX`` does), before the process starts its threads.

    glibc gives threads that contend for the heap arenas of their own, up to 8 per core, each grown and kept. A node
    runs a dozen threads (loop, model, timers, senders, pulls, lookups, HTTP), so its RSS rose in steps of 1 to 15 MB
    long after warm-up, a different node each run: a 20,000-request soak read 0.17 to 0.83 KB per request on one
    node or another. With two arenas the same soak read 0.003 (prefill), 0.015 (decode) and 0.038 (router) KB per
    request. Returns False where there is no glibc (musl, macOS) and nothing was changed."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    try:
        mallopt = ctypes.CDLL(libc_name).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_ARENA_MAX, arenas))
