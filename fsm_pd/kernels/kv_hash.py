"""The KV checksum computed where the pool lives: a position-mixed integer hash of a room's pages, on the device.

Same parts, pages and ``[part][layer]`` shape as ``kv_checksum.pool_checksums`` (crc32c on the host), so P and D
compare it with the same code (``effects/checksums.py``); only the function differs, and its name (``ALGORITHM``)
travels with the values (READY's ``kv_checksum_algorithm``).

The value of one part of one layer: every element of the part's bytes, in the canonical order (pages in transfer
order, each page ``[page_size, 2 * count * head_dim]`` row-major, padding rows left out), read as an unsigned integer
of its own width (bf16: 16 bits) and zero-extended to 32 bits, is XORed with a key of its position ``i`` in that
order and passed through murmur3's 32-bit finalizer; the terms are added with wrapping uint32 arithmetic.

* Why it catches a changed element for certain: for a fixed position the term is a bijection of the element (XOR
  with a constant, then a finalizer made of bijective steps), so changing one element changes exactly one term.
* Why it catches pages swapped or replaced by another valid page: the key makes each term depend on where the
  element sits, so moved bytes give unrelated terms (a plain sum, or a sum of unkeyed terms, is blind to order).
  Like any 32-bit hash it misses such a change with probability about 2^-32.
* Why a sum: wrapping addition is associative and commutative, so the reduction order XLA picks (per device, per
  tile) cannot change the value, and P and D agree over different splits of the pool.

One compiled program per page-count bucket (``page_buckets.page_bucket``: the page ids are padded with the padding
page and masked), per pool shape and per set of parts. It reads the room's pages of each layer through a gather of
those pages (never a copy of the pool), returns ``uint32[parts, layers]``, and runs on the model thread in the job
that owns the pool, like the crc; the pool is an input, never donated.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fsm_pd.kernels.layout import PAD_PAGE, slot_lanes
from fsm_pd.kernels.page_buckets import page_bucket

ALGORITHM = "kvmix32"

_KEY = 0x9E3779B1  # odd: the position key i * _KEY is a bijection of i
_M1, _M2 = 0x85EBCA6B, 0xC2B2AE35  # murmur3 fmix32


def _fmix(x: jax.Array) -> jax.Array:
    x = x ^ (x >> 16)
    x = x * jnp.uint32(_M1)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(_M2)
    return x ^ (x >> 16)


def _words(x: jax.Array) -> jax.Array:
    """Each element's bits as a uint32 (zero-extended): no repacking of 16-bit pairs, which a TPU would relayout."""
    width = x.dtype.itemsize * 8
    if width > 32:
        raise ValueError(f"the device KV hash reads elements of at most 32 bits, not {x.dtype}")
    bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{width}"))
    return bits.astype(jnp.uint32)


def _digest(pages: jax.Array, count: jax.Array) -> jax.Array:
    """The hash of ``pages[:count]`` (``[bucket, page_size, lanes]``); rows at and after ``count`` are padding."""
    shape = pages.shape
    index = [jax.lax.broadcasted_iota(jnp.uint32, shape, axis) for axis in range(3)]
    position = (index[0] * jnp.uint32(shape[1]) + index[1]) * jnp.uint32(shape[2]) + index[2]
    terms = _fmix(_words(pages) ^ (position * jnp.uint32(_KEY)))
    terms = jnp.where(index[0] < count.astype(jnp.uint32), terms, jnp.uint32(0))
    return jnp.sum(terms, dtype=jnp.uint32)


@partial(jax.jit, static_argnames=("lanes",))
def _hash(layers: tuple, ids: jax.Array, count: jax.Array, lanes: tuple) -> jax.Array:
    rows = []
    for layer in layers:
        pages = layer.at[ids].get(mode="promise_in_bounds")
        rows.append(jnp.stack([_digest(pages[:, :, start:stop], count) for start, stop in lanes]))
    return jnp.stack(rows, axis=1)


def device_checksums(pool: Sequence[Any], pages: Sequence[int], parts: Sequence[tuple[int, int, int]],
                     head_dim: int) -> list[list[int]]:
    """``[part][layer]`` hash of ``pages`` of ``pool`` (one array per layer), computed on the pool's devices; parts as
    ``kv_checksum.Part``. Run it on the thread that owns the pool (a model-thread job): it blocks on the result."""
    if not pages:
        return [[0] * len(pool) for _ in parts]
    first = pool[0]
    width = first.sharding.shard_shape(first.shape)[2]  # a shard's lanes: part (shard, slot, n) sits at shard*width
    lanes = []
    for shard, slot, count in parts:
        local = slot_lanes(head_dim, slot, count)
        lanes.append((shard * width + local.start, shard * width + local.stop))
    ids = np.full(page_bucket(len(pages)), PAD_PAGE, np.int32)
    ids[: len(pages)] = pages
    values = _hash(tuple(pool), ids, np.int32(len(pages)), tuple(lanes))
    return np.asarray(values).astype(np.int64).tolist()
