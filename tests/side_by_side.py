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

from fsm_pd.runtime.switch_interval import brief_turns

T = TypeVar("T")

ENV = "FSM_PD_SUITE_SIDE_BY_SIDE"  # threads to use, where the default (below) is not wanted


def threads() -> int:
    """Up to 6: about what the chip's process has to itself beside the CPU half's 8 workers on a 13-core host. On
    this project's loaded 2-core machines they gain nothing and cost nothing (test_layer_groups: 9.4 s, against 8.6
    to 9.0 one after the other), which keeps the chip's path tried on the CPU. ``FSM_PD_SUITE_SIDE_BY_SIDE=N`` sets
    N (1: one after the other)."""
    if os.environ.get(ENV):
        return max(1, int(os.environ[ENV]))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(6, cores))


def side_by_side(thunks: list[Callable[[], T]], workers: int | None = None) -> list[T]:
    """Each thunk's result, in order, run on up to ``workers`` threads at once (default ``threads()``); the first
    failure is raised. The interpreter's lock changes hands in brief turns meanwhile: a thread back from XLA's
    compile waits for it while another traces, up to 5 ms a turn by default (``fsm_pd/runtime/switch_interval.py``;
    without them test_layer_groups took 14 to 19 s on 2 cores)."""
    workers = threads() if workers is None else workers
    if len(thunks) <= 1 or workers <= 1:
        return [thunk() for thunk in thunks]
    with brief_turns(), ThreadPoolExecutor(min(workers, len(thunks)), thread_name_prefix="side-by-side") as pool:
        futures = [pool.submit(thunk) for thunk in thunks]
        return [future.result() for future in futures]


def each_program(thunks: dict) -> dict:
    """``ForwardPrograms.compile``'s ``run``: a forward shape's programs (each group size, the head, the embedding)
    side by side, as a node's warm-up compiles them."""
    return dict(zip(thunks, side_by_side(list(thunks.values())), strict=True))


def forward_shapes(programs, shapes) -> list:
    """``programs.compile`` of each ``(batch, tokens)`` in ``shapes``, all their programs side by side."""
    return side_by_side([lambda shape=shape: programs.compile(*shape, run=each_program) for shape in shapes])
