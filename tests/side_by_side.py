"""A test's independent programs compiled side by side, on threads, before it runs them.

On a TPU host the chip half's time is mostly XLA compiling (a whole-model program with the Pallas kernels takes
seconds), and XLA's compile lets go of the interpreter's lock: N programs compiled on N threads take about as long
as the slowest, where the host has the cores (a TPU v5e host has 13, of which the CPU half's workers take 8; serving
nodes compile their ready set the same way, ``fsm_pd/serving/warmup.py``). Tracing and lowering hold the lock and
still go one at a time. What a test checks does not change: a program compiled ahead (``jit(f).lower(...).compile()``
with the arguments' shapes, dtypes and placements) is the one the call finds in ``jit``'s own cache, and a program
compiled on another thread is the same program.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

# about what the chip's process has to itself beside the CPU half's 8 workers on a 13-core host; on 2 cores more
# threads only wait for each other
THREADS = max(1, min(6, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def side_by_side(thunks: list[Callable[[], T]], threads: int = THREADS) -> list[T]:
    """Each thunk's result, in order, run on up to ``threads`` threads at once; the first failure is raised."""
    if len(thunks) <= 1 or threads <= 1:
        return [thunk() for thunk in thunks]
    with ThreadPoolExecutor(min(threads, len(thunks)), thread_name_prefix="side-by-side") as workers:
        futures = [workers.submit(thunk) for thunk in thunks]
        return [future.result() for future in futures]
