"""Page copies at memcpy speed for pools on one CPU device (``impl="cpu"``, what ``"auto"`` picks there).

Why not XLA's gather and scatter: on CPU both are element loops (~1.3 and ~2.8 GB/s on the dev VM), and every
gather writes a freshly allocated staging array. A fresh 64 MiB buffer is ~16k first-touch page faults, which cost
more than the copy itself. A page of one layer is one contiguous block of bytes (axis 0), so both directions are a
handful of block copies per layer:

* gather: NumPy copies whole runs of consecutive pages (``runs.page_runs``) out of a zero-copy view of each pool
  layer into a *warm*, 64-byte-aligned host block, which ``device_put`` then aliases (zero-copy on CPU for aligned
  buffers). Blocks are recycled once nothing refers to them (see ``host_blocks``). One core copies ~6 GB/s here
  (XLA's in-place update loop reaches ~11 with its own threads), so large gathers split the layers over two
  helper threads (NumPy copies release the GIL: ~10 GB/s); the caller waits for them, so the pool is still only
  read while its owner is blocked in ``gather_pages``. Reading the pool through a NumPy
  view is synchronous and outside XLA's ordering, so this is only safe on the thread that owns the pool (the model
  thread): ``np.asarray`` waits for pending writes, and no other thread may donate the pool meanwhile. Padding rows
  hold copies of page 0, as with ``"jnp"``, so a recycled block never ships another request's KV.
* scatter: a jitted ``fori_loop`` of ``dynamic_update_slice``, one page per step, on the donated pool. XLA updates
  donated buffers in place, so each step is a page-sized memcpy (~10 GB/s against ~2.8 for the XLA scatter). The
  loop runs to the real page count, a runtime scalar: padding rows are never written and a new length within a
  bucket compiles nothing.

A scatter over all of a pool's layers compiles a program per page bucket whose cost grows with the layers (SmolLM2's
30: 1.7 s each, 16 buckets). A node must not wait for them before it serves, so ``scatter`` runs a bucket in one of
two ways: the whole-pool program once ``prepare_scatter`` compiled it (a serving node's background compile), else
layer by layer on the one-layer program of that bucket (0.15 s to compile; warm-up prepares those). Both write the
same bytes; layer by layer took 1.6x as long for 64 and 256 pages of SmolLM2 (9.4 against
5.6 ms, 37 against 23 ms), about as long for 8.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import jax
import numpy as np
from jax import lax

from fsm_pd.kernels.host_blocks import HostBlocks
from fsm_pd.kernels.layout import PAD_PAGE
from fsm_pd.kernels.runs import page_runs
from fsm_pd.kernels.validation import Pool

# Enough for a few staging arrays in flight at once; beyond it blocks are plain (cold) allocations. Every size is
# pooled: a small gather paid for in page faults is still a gather paid twice.
warm_blocks = HostBlocks(max_bytes=1 << 30, min_pooled_bytes=0)


_PARALLEL_BYTES = 4 << 20  # below this, starting helper threads costs more than it saves
_WORKERS = min(2, os.cpu_count() or 1)
_helpers: ThreadPoolExecutor | None = None
_helpers_lock = threading.Lock()


def _copy_threads() -> ThreadPoolExecutor:
    global _helpers
    with _helpers_lock:
        if _helpers is None:
            _helpers = ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="page-copy")
        return _helpers


def host_block(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A warm, aligned host array of ``shape`` to gather into (see ``host_blocks``)."""
    (block,) = warm_blocks.arrays([(shape, dtype)])
    return block


def _layer_copier(pool: Pool, ids: np.ndarray, out: np.ndarray) -> Callable[[int], None]:
    """``copy(i)`` fills ``out[i]`` from layer ``i``: rows ``< n`` from pages ``ids`` (a block copy per run of
    consecutive pages), the rest from page 0."""
    rows = out.shape[1]
    runs = page_runs(ids, rows)
    count = int(runs.num_runs[0])
    spans = list(zip(*(a[:count].tolist() for a in (runs.page_starts, runs.row_starts, runs.lengths)), strict=True))
    sources = [np.asarray(layer) for layer in pool]  # zero-copy views on CPU; wait for pending writes

    def copy(index: int) -> None:
        staged, src = out[index], sources[index]
        for page, row, length in spans:
            staged[row : row + length] = src[page : page + length]
        if ids.size < rows:
            staged[ids.size :] = src[PAD_PAGE]

    return copy


def gather_host(pool: Pool, ids: np.ndarray, rows: int) -> jax.Array:
    """Stack pages ``ids`` of every layer into rows ``0..n`` of a new ``[L, rows, ...]`` array; rows past ``n`` hold
    page 0. Only call this on the thread that owns ``pool``."""
    out = host_block((len(pool), rows, *pool[0].shape[1:]), pool[0].dtype)
    copy = _layer_copier(pool, ids, out)
    if out.nbytes < _PARALLEL_BYTES or len(pool) < 2 or _WORKERS < 2:
        for index in range(len(pool)):
            copy(index)
    else:
        half = len(pool) // 2
        first = _copy_threads().submit(lambda: [copy(i) for i in range(half)])
        for index in range(half, len(pool)):  # this thread takes the other half
            copy(index)
        first.result()
    # Committed like the pool: jit keys its cache on committedness, so a mismatch would compile a second scatter.
    committed = getattr(pool[0], "_committed", True)
    return jax.device_put(out, pool[0].sharding if committed else None)


def gather_into(pool: Pool, ids: np.ndarray, out: np.ndarray, on_layer: Callable[[int], None]) -> None:
    """Fill host staging ``out`` layer by layer, in order, calling ``on_layer(i)`` once ``out[i]`` is final.

    One thread, on purpose: this runs while a transfer streams the finished layers, and the wire needs the other
    core. Only call this on the thread that owns ``pool``.
    """
    copy = _layer_copier(pool, ids, out)
    for index in range(len(pool)):
        copy(index)
        on_layer(index)


# Scatter programs compiled ahead (``prepare_scatter``), by ``_signature``: whole-pool ones, and the one-layer ones
# a whole-pool scatter may run layer by layer until its own is there.
_compiled: dict[tuple, jax.stages.Compiled] = {}


def _signature(pool: Pool, staging) -> tuple:
    # The sharding too: pools of one shape on other devices (a TP-2 and a TP-4 pool in one process) take other
    # programs, and running one with another's arrays fails deep in XLA (std::bad_cast).
    return (len(pool), tuple(pool[0].shape), str(pool[0].dtype), pool[0].sharding, tuple(staging.shape[1:]),
            str(staging.dtype))


def scatter(pool: Pool, staging: jax.Array, row_pages: np.ndarray, count: np.int32) -> Pool:
    """``scatter_loop`` on the donated ``pool``: in one program where ``prepare_scatter`` compiled it, else layer by
    layer where the one-layer program is compiled, else in one program compiled now (a node with no warm-up)."""
    program = _compiled.get(_signature(pool, staging))
    if program is not None:
        return program(tuple(pool), staging, row_pages, count)
    one_layer = _compiled.get(_signature(pool[:1], staging)) if len(pool) > 1 else None
    if one_layer is None:
        return scatter_loop(tuple(pool), staging, row_pages, count)
    # each layer's staging is a zero-copy view: a layer of ``staging`` is one aligned, contiguous block
    host = np.asarray(staging)
    return tuple(one_layer((layer,), jax.device_put(host[i : i + 1], layer.sharding), row_pages, count)[0]
                 for i, layer in enumerate(pool))


def prepare_scatter(pool: Pool, rows: int, layers: int) -> None:
    """Compile, ahead and without running it, the scatter of staging with ``rows`` rows into the first ``layers``
    layers of pools shaped like ``pool`` (arrays or ``jax.ShapeDtypeStruct``s: it reads only shapes, so any thread
    may call it); from then on ``scatter`` uses it."""
    part = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for a in pool[:layers])
    staging = jax.ShapeDtypeStruct((layers, rows, *pool[0].shape[1:]), pool[0].dtype, sharding=pool[0].sharding)
    key = _signature(part, staging)
    if key not in _compiled:
        _compiled[key] = scatter_loop.lower(part, staging, jax.ShapeDtypeStruct((rows,), np.int32),
                                            jax.ShapeDtypeStruct((), np.int32)).compile()


@partial(jax.jit, donate_argnums=0)
def scatter_loop(pool: Pool, staging: jax.Array, row_pages: jax.Array, count: jax.Array) -> Pool:
    """Write staging row ``r`` of every layer into page ``row_pages[r]`` for ``r < count``; the pool is donated.

    row_pages: int32[rows] (entries past ``count`` are ignored); count: int32 scalar. One compile per bucket.
    """
    page_shape = pool[0].shape[1:]

    def step(r, layers):
        page = row_pages[r]
        return tuple(
            lax.dynamic_update_slice(
                layer, lax.dynamic_slice(staging, (i, r, 0, 0), (1, 1, *page_shape))[0], (page, 0, 0)
            )
            for i, layer in enumerate(layers)
        )

    return lax.fori_loop(0, count, step, tuple(pool))
