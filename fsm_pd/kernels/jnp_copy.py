"""Gather and scatter of pages in plain ``jax.numpy``: the portable implementation, and the reference on TPU.

XLA turns ``layer[ids]`` into one gather and ``layer.at[ids].set`` into one in-place scatter per layer; all layers go
in one jitted call so they compile and dispatch together. Page ids are runtime arrays of the bucket's length, so a
new request compiles nothing unless its page count crosses into a new bucket.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding

from fsm_pd.kernels.pool_format import PoolJit
from fsm_pd.kernels.validation import Pool


@partial(jax.jit, static_argnames=("out_sharding",))
def gather_rows(pool: Pool, row_pages: jax.Array, out_sharding: NamedSharding | None = None) -> jax.Array:
    """Stack page ``row_pages[r]`` of every layer into staging row ``r``.

    pool: L x [num_pages, page_size, 2HD]; row_pages: int32[rows], padding rows point at page 0.
    Returns [L, rows, page_size, 2HD].
    """
    staging = jnp.stack([layer.at[row_pages].get(mode="promise_in_bounds") for layer in pool])
    if out_sharding is not None:
        staging = _place(staging, out_sharding)
    return staging


def _place(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """Pin ``x`` to ``sharding`` inside jit: ``reshard`` for Explicit mesh axes, a sharding constraint for Auto ones."""
    axis_types = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_types, strict=True))
    named = [
        name
        for entry in sharding.spec
        if entry is not None
        for name in (entry if isinstance(entry, tuple) else (entry,))
    ]
    if any(axis_types[name] == AxisType.Explicit for name in named):
        return jax.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


# the pool's results row-major, as it comes in (``pool_format.py``)
@partial(PoolJit, pool="pool", results=lambda pool: pool, donate_argnums=0)
def scatter_rows(pool: Pool, staging: jax.Array, row_pages: jax.Array) -> Pool:
    """Write staging row ``r`` of every layer into page ``row_pages[r]``; the pool is donated and updated in place.

    pool: L x [num_pages, page_size, 2HD]; staging: [L, rows, page_size, 2HD]; row_pages: int32[rows].
    Padding rows carry distinct ids >= num_pages, which ``mode="drop"`` discards: they never touch the pool, not
    even page 0, and since every id is distinct ``unique_indices`` is a true promise (XLA may then write in parallel).
    """
    return tuple(
        layer.at[row_pages].set(staging[index], mode="drop", unique_indices=True) for index, layer in enumerate(pool)
    )
