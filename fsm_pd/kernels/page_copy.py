"""The public page kernels: validate in Python, bucket the page count, then run one jitted call for all layers.

``gather_pages`` copies a request's pages out of the pool into one staging array; ``scatter_pages`` writes a staging
array into pages of another pool, donating it. Two implementations sit behind them: ``"jnp"`` (XLA gather/scatter,
any backend), ``"pallas"`` (DMA kernels, TPU; interpret mode elsewhere) and ``"cpu"`` (block copies at memcpy
speed for a pool on one CPU device, see ``cpu_copy``). ``"auto"`` picks Pallas on TPU and ``"cpu"`` for an unsharded
CPU pool.

Staging is ONE stacked array ``[num_layers, rows, page_size, 2*kv_heads*head_dim]`` rather than a tuple of per-layer
arrays: a transfer then registers, pulls, checks and host-copies a single buffer whose shape both sides derive from
the page count (``KVLayout.staging_shape(page_bucket(n))``), and the ZMQ fallback sends it as one contiguous payload.
``rows = page_bucket(len(page_ids))``; rows ``>= len(page_ids)`` are padding (copies of page 0 from ``"jnp"`` and
``"cpu"``, unspecified from ``"pallas"``) and scatter never writes them anywhere.

For a transfer that overlaps the copies with the wire there are per-layer variants: ``gather_pages_into`` fills a
host staging array layer by layer and reports each finished layer (P streams it while the next is copied), and
``scatter_layer`` writes one layer (D writes layer ``i`` while ``i + 1`` is still arriving). Layer ``i`` of a staging
array is one contiguous byte range, so "the first ``k`` layers are final" is the same as "the first ``k * layer
bytes`` are final", which is all a byte stream needs to know.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import jax
import numpy as np

from fsm_pd.kernels import cpu_copy, jnp_copy
from fsm_pd.kernels.layout import PAD_PAGE, KVLayout
from fsm_pd.kernels.page_buckets import page_bucket
from fsm_pd.kernels.placement import pool_placement
from fsm_pd.kernels.runs import page_runs
from fsm_pd.kernels.validation import Pool, check_page_ids, check_pool, check_staging

Impl = Literal["auto", "jnp", "pallas", "cpu"]
PageIds = Sequence[int] | np.ndarray | jax.Array

# Mosaic lays the last axis out in 128-lane tiles; tpu-inference pads narrower head dims to 128 before its DMA
# kernel. We do not pad (that would copy the whole pool), so "auto" keeps such pools on the XLA path.
_LANES = 128


def _platform(pool: Pool) -> str:
    # from the placement, which a donated array keeps (``devices()`` raises on it): ``resolve_impl`` is asked off the
    # model thread too (``warmup.compile_rest``), where ``owner.pool`` may name the arrays a forward pass donated
    return next(iter(pool[0].sharding.device_set)).platform


def resolve_impl(pool: Sequence[jax.Array], impl: Impl = "auto") -> Literal["jnp", "pallas", "cpu"]:
    """The implementation ``impl`` means for this pool: ``"auto"`` is Pallas on TPU for lane-aligned head dims,
    ``"cpu"`` for a pool on one CPU device, else ``"jnp"``."""
    if impl == "auto":
        platform = _platform(tuple(pool))
        if platform == "tpu":
            return "pallas" if pool[0].shape[-1] % _LANES == 0 else "jnp"
        if platform == "cpu" and isinstance(pool[0].sharding, jax.sharding.SingleDeviceSharding):
            return "cpu"
        return "jnp"
    if impl == "cpu" and not isinstance(pool[0].sharding, jax.sharding.SingleDeviceSharding):
        raise ValueError("impl='cpu' needs a pool on one device; use 'jnp' for a sharded pool")
    if impl not in ("jnp", "pallas", "cpu"):
        raise ValueError(f"unknown kernel implementation {impl!r}: use 'auto', 'jnp', 'pallas' or 'cpu'")
    return impl


def gather_pages(
    pool: Sequence[jax.Array], page_ids: PageIds, *, impl: Impl = "auto", layout: KVLayout | None = None
) -> jax.Array:
    """Copy pages ``page_ids`` of every layer, in that order, into a new staging array.

    pool: L x [num_pages, page_size, 2HD]. Returns [L, page_bucket(n), page_size, 2HD], placed like the pool
    (sharded on axis 3 where the pool is sharded on axis 2). The pool is only read. Raises ``ValueError`` for page
    ids that are not distinct ints in ``[1, num_pages)``. With ``"cpu"`` (the default on CPU) the copy is done
    before this returns, reading the pool directly: call it only on the thread that owns the pool.
    """
    pool = check_pool(pool, layout)
    ids = check_page_ids(page_ids, pool[0].shape[0])
    rows = page_bucket(ids.size)
    placement = pool_placement(pool)
    chosen = resolve_impl(pool, impl)
    if chosen == "cpu":
        return cpu_copy.gather_host(pool, ids, rows)
    if chosen == "pallas":
        runs = page_runs(ids, rows)
        from fsm_pd.kernels import pallas_copy  # imported here: Pallas costs a CPU node 0.3 s of start-up

        return pallas_copy.gather_runs(pool, runs, rows, placement=placement, interpret=_platform(pool) != "tpu")
    row_pages = np.full(rows, PAD_PAGE, dtype=np.int32)
    row_pages[: ids.size] = ids
    out_sharding = None if placement is None else placement.staging_sharding
    return jnp_copy.gather_rows(pool, row_pages, out_sharding=out_sharding)


def scatter_pages(
    pool: Sequence[jax.Array],
    staging: jax.Array,
    page_ids: PageIds,
    *,
    impl: Impl = "auto",
    layout: KVLayout | None = None,
) -> Pool:
    """Write staging row ``i`` of every layer into page ``page_ids[i]``; rows past ``len(page_ids)`` are ignored.

    staging: [L, rows >= n, page_size, 2HD]. The pool is DONATED: its arrays are invalid afterwards, use the
    returned tuple (same shapes and sharding). Validation happens before donation, so a rejected call leaves the pool
    intact. A staging array with a bucketed row count compiles once per bucket.
    """
    pool = check_pool(pool, layout)
    ids = check_page_ids(page_ids, pool[0].shape[0])
    check_staging(staging, pool, ids.size)
    rows = staging.shape[1]
    placement = pool_placement(pool)
    chosen = resolve_impl(pool, impl)
    if chosen == "cpu":
        row_pages = np.zeros(rows, dtype=np.int32)
        row_pages[: ids.size] = ids
        return cpu_copy.scatter(pool, staging, row_pages, np.int32(ids.size))
    if chosen == "pallas":
        runs = page_runs(ids, rows)
        from fsm_pd.kernels import pallas_copy

        return pallas_copy.scatter_runs(pool, staging, runs, placement=placement, interpret=_platform(pool) != "tpu")
    num_pages = pool[0].shape[0]
    # Padding rows get distinct out-of-range ids, which the scatter drops (see jnp_copy.scatter_rows).
    row_pages = np.arange(num_pages, num_pages + rows, dtype=np.int32)
    row_pages[: ids.size] = ids
    return jnp_copy.scatter_rows(pool, staging, row_pages)


def staging_block(layout: KVLayout, num_pages: int) -> np.ndarray:
    """A warm, 64-byte-aligned host array ``[L, page_bucket(num_pages), ...]`` for ``gather_pages_into``."""
    return cpu_copy.host_block(layout.staging_shape(page_bucket(num_pages)), np.dtype(layout.dtype))


def gather_pages_into(
    pool: Sequence[jax.Array],
    page_ids: PageIds,
    out: np.ndarray,
    *,
    on_layer: Callable[[int], None] = lambda index: None,
    layout: KVLayout | None = None,
) -> None:
    """``gather_pages`` into the host array ``out``, one layer at a time, calling ``on_layer(i)`` as soon as
    ``out[i]`` is final (layers complete in order). Pools on one CPU device only (``impl="cpu"``); call it on the
    thread that owns the pool. ``out`` must be ``[L, page_bucket(n), page_size, 2HD]`` of the pool's dtype."""
    pool = check_pool(pool, layout)
    ids = check_page_ids(page_ids, pool[0].shape[0])
    if resolve_impl(pool) != "cpu":
        raise ValueError("gather_pages_into needs a pool on one CPU device; use gather_pages elsewhere")
    want = (len(pool), page_bucket(ids.size), *pool[0].shape[1:])
    if not isinstance(out, np.ndarray) or out.shape != want or out.dtype != np.dtype(pool[0].dtype):
        got = f"{getattr(out, 'dtype', '?')}{list(getattr(out, 'shape', ()))}"
        raise ValueError(f"gather_pages_into: out is {got}, expected {np.dtype(pool[0].dtype)}{list(want)}")
    if not out.flags.writeable or not out.flags.c_contiguous:
        raise ValueError("gather_pages_into: out must be a writable, C-contiguous array")
    cpu_copy.gather_into(pool, ids, out, on_layer)


def scatter_layers(
    pool: Sequence[jax.Array], start: int, staged: jax.Array, page_ids: PageIds, *, impl: Impl = "auto"
) -> Pool:
    """``scatter_pages`` for layers ``start .. start + g`` alone: ``staged`` is ``[g, rows >= n, page_size, 2HD]``.

    Only those layers of the pool are donated; the others are returned as they were. One compile per (g, bucket).
    """
    pool = check_pool(pool)
    count = int(getattr(staged, "shape", (0,))[0])
    if not (start >= 0 and count >= 1 and start + count <= len(pool)):
        raise ValueError(f"layers {start}..{start + count} are out of range for a pool of {len(pool)} layers")
    written = scatter_pages(pool[start : start + count], staged, page_ids, impl=impl)
    return (*pool[:start], *written, *pool[start + count :])
