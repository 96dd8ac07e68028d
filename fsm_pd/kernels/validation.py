"""Checks that run in Python before any kernel is traced, so bad input fails loudly instead of corrupting the pool.

Inside ``jit`` an out-of-range page id is clamped or dropped without a word, and a duplicate id makes a scatter write
the same page twice in an unspecified order. Both would silently mix one request's KV into another's, so every public
kernel validates its page ids here first and raises ``ValueError`` naming the offending ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from fsm_pd.kernels.layout import PAD_PAGE, KVLayout

Pool = tuple[jax.Array, ...]

_SHOWN_IDS = 10  # how many offending ids an error message lists before it says "and N more"


def _show(ids: np.ndarray) -> str:
    listed = ", ".join(str(int(i)) for i in ids[:_SHOWN_IDS])
    more = f" and {len(ids) - _SHOWN_IDS} more" if len(ids) > _SHOWN_IDS else ""
    return f"[{listed}]{more}"


def check_pool(pool: Sequence[jax.Array], layout: KVLayout | None = None) -> Pool:
    """The pool as a tuple, after checking every layer is ``[num_pages, page_size, 2*kv_heads*head_dim]`` alike."""
    pool = tuple(pool)
    if not pool:
        raise ValueError("the KV pool has no layers")
    first = pool[0]
    for index, layer in enumerate(pool):
        if not hasattr(layer, "shape") or len(layer.shape) != 3:
            raise ValueError(f"pool layer {index} must be a 3-D array [pages, page_size, 2*kv_heads*head_dim]")
        if layer.shape != first.shape or layer.dtype != first.dtype:
            got, want = f"{layer.dtype}{list(layer.shape)}", f"{first.dtype}{list(first.shape)}"
            raise ValueError(f"pool layer {index} is {got} but layer 0 is {want}")
    if first.shape[2] % 2:
        raise ValueError(f"pool axis 2 holds K and V of each head, so it must be even, got {first.shape[2]}")
    if first.shape[0] < 2:
        raise ValueError("the pool needs at least 2 pages: page 0 is the reserved padding page")
    if layout is not None:
        expected = (layout.num_layers, layout.layer_shape, np.dtype(layout.dtype))
        got = (len(pool), tuple(first.shape), np.dtype(first.dtype))
        if expected != got:
            raise ValueError(f"pool (layers, layer shape, dtype) {got} does not match its layout {expected}")
    return pool


def check_page_ids(page_ids: Sequence[int] | np.ndarray | jax.Array, num_pages: int) -> np.ndarray:
    """``page_ids`` as a 1-D int32 array, after checking they are distinct ints in ``[1, num_pages)``."""
    if isinstance(page_ids, (list, tuple)):
        wrong = [p for p in page_ids if isinstance(p, bool) or not isinstance(p, (int, np.integer))]
        if wrong:
            raise ValueError(f"page ids must be ints, got {wrong[:_SHOWN_IDS]!r}")
    ids = np.asarray(page_ids)
    if ids.ndim != 1:
        raise ValueError(f"page ids must be a 1-D sequence, got shape {ids.shape}")
    if ids.size == 0:
        raise ValueError("page ids are empty: there is nothing to copy")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"page ids must be ints, got dtype {ids.dtype}")
    bad = np.unique(ids[(ids < 1) | (ids >= num_pages)])
    if bad.size:
        reserved = f" (page {PAD_PAGE} is the reserved padding page)" if PAD_PAGE in bad else ""
        raise ValueError(f"page ids {_show(bad)} are out of range [1, {num_pages}){reserved}")
    values, counts = np.unique(ids, return_counts=True)
    repeated = values[counts > 1]
    if repeated.size:
        raise ValueError(f"page ids {_show(repeated)} appear more than once")
    return ids.astype(np.int32)


def check_staging(staging: jax.Array, pool: Pool, num_pages: int) -> None:
    """Check ``staging`` is ``[num_layers, rows >= num_pages, page_size, 2*kv_heads*head_dim]`` of the pool's dtype."""
    shape = tuple(getattr(staging, "shape", ()))
    page_shape = tuple(pool[0].shape[1:])
    if len(shape) != 4 or shape[0] != len(pool) or shape[2:] != page_shape:
        raise ValueError(
            f"staging shape {list(shape)} does not match the pool: expected [{len(pool)}, rows, "
            f"{', '.join(map(str, page_shape))}]"
        )
    if shape[1] < num_pages:
        raise ValueError(f"staging holds {shape[1]} pages but {num_pages} page ids were given")
    if np.dtype(staging.dtype) != np.dtype(pool[0].dtype):
        raise ValueError(f"staging dtype {staging.dtype} does not match the pool dtype {pool[0].dtype}")
