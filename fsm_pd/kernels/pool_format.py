"""A KV pool's layout in device memory: row-major, pinned in every program that takes the pool and returns it.

A pool layer ``[pages, page_size, lanes]`` (``KVLayout.layer_shape``) is laid out by a TPU in tiles of 8 (or 16) x
128 on its last two axes. Rows narrower than 128 lanes (the tiny model's 64, a split SmolLM2's 192) would be padded
there, so from about 100 pages up XLA's *default* TPU layout for such an array puts the page axis minor instead
(major-to-minor ``(1, 2, 0)``, no padding). Every program reads and writes whole pages, which wants rows in order:
with the default layout at its parameters and results, XLA copies each layer into row-major on the way in and back
on the way out, so the program's temporaries grow with the pool (the 13-layer tiny step at 4096 pages: 0 -> 70 MB;
``--role pd``'s pool of 3.3M pages: 37.8 GB, refused by the compiler on a 16 GB v5e) and donation buys nothing.

So a pool is made row-major (``zeros``), a program compiled ahead takes it row-major (``abstract_pool``), and every
program that returns a pool pins its results to the row-major layout of the pool it was given (``PoolJit``). Its
parameters need no pin: ``jit`` compiles for the layout of the committed arrays it is called with. Where row-major is
already the default (any pool on a CPU; rows of whole 128 lanes on a TPU, as SmolLM2's 384 unsplit) nothing changes.

The price: a narrow row takes whole 128 lanes in device memory (the tiny model's pool twice its bytes).
``page_bytes`` measures what a page takes there, and ``--role pd`` sizes its pool by it. ``bench/tpu_aot.py``
compiles the serving programs for a TPU v5e on a machine without one and shows the layouts and temporaries.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental.layout import Format, Layout

ROW_MAJOR = Layout(major_to_minor=(0, 1, 2))  # pages, then rows, then lanes: each page one contiguous block


def pool_format(sharding: jax.sharding.Sharding) -> Format:
    """A pool layer's format: row-major, placed by ``sharding``."""
    return Format(ROW_MAJOR, sharding)


def formats(pool: Sequence) -> tuple[Format, ...]:
    """The format of each layer of ``pool`` (arrays or ``jax.ShapeDtypeStruct``s), row-major where each is placed."""
    return tuple(pool_format(layer.sharding) for layer in pool)


def abstract_pool(pool: Sequence) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Shapes only, each layer row-major where it is placed: the pool a program compiled ahead of time takes."""
    return tuple(jax.ShapeDtypeStruct(layer.shape, layer.dtype, sharding=pool_format(layer.sharding))
                 for layer in pool)


def zeros(shape: tuple[int, ...], dtype, sharding: jax.sharding.Sharding, layers: int) -> tuple[jax.Array, ...]:
    """A zeroed pool of ``layers`` arrays of ``shape``, row-major and committed to ``sharding``."""
    make = _zeros(tuple(shape), jnp.dtype(dtype), sharding)
    return tuple(make() for _ in range(layers))


@functools.lru_cache(maxsize=64)
def _zeros(shape: tuple[int, ...], dtype, sharding: jax.sharding.Sharding):
    # one program per pool shape and placement, kept: a jit made per pool was traced, lowered and looked up in the
    # compile cache again for every engine a process made (the suite's chip half: about 80 of its programs)
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=pool_format(sharding))


PAGES_MEASURED = 64  # pages of the array whose compiled size ``page_bytes`` divides (a whole number of tiles)


def page_bytes(page_shape: tuple[int, int], dtype, sharding: jax.sharding.Sharding) -> int:
    """Bytes one page of one layer takes in the memory of ``sharding``'s devices, row-major, padding included: the
    size the compiler gives a zeroed array of ``PAGES_MEASURED`` such pages, over that many (nothing is allocated)."""
    make = jax.jit(lambda: jnp.zeros((PAGES_MEASURED, *page_shape), dtype), out_shardings=pool_format(sharding))
    return make.lower().compile().memory_analysis().output_size_in_bytes // PAGES_MEASURED


class PoolJit:
    """``jax.jit(fun, **options)`` for a ``fun`` that returns the pool it takes (argument ``pool``), its pool results
    pinned row-major where the pool it is called with is placed: ``results(formats)`` is ``out_shardings`` given the
    per-layer formats (None for the results left unpinned). A concrete layout needs a concrete sharding, so there is
    one jit per placement of the pool, made on first use; called and lowered like the jit."""

    def __init__(self, fun: Callable, *, pool: str, results: Callable[[tuple[Format, ...]], object], **options):
        self._fun, self._pool, self._results, self._options = fun, pool, results, options
        self._index = list(inspect.signature(fun).parameters).index(pool)
        self._jits: dict[tuple, Callable] = {}
        self._lock = threading.Lock()
        functools.update_wrapper(self, fun)

    def for_pool(self, pool: Sequence):
        """The jit for pools placed like ``pool``."""
        key = tuple(layer.sharding for layer in pool)  # a donated array keeps its sharding
        jitted = self._jits.get(key)
        if jitted is None:
            pinned = self._results(tuple(pool_format(sharding) for sharding in key))
            with self._lock:
                jitted = self._jits.setdefault(key, jax.jit(self._fun, out_shardings=pinned, **self._options))
        return jitted

    def _pool_of(self, args, kwargs):
        return kwargs[self._pool] if self._pool in kwargs else args[self._index]

    def __call__(self, *args, **kwargs):
        return self.for_pool(self._pool_of(args, kwargs))(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self.for_pool(self._pool_of(args, kwargs)).lower(*args, **kwargs)

    def _cache_size(self) -> int:
        """Programs compiled over every placement (``jax.jit``'s own count, summed)."""
        return sum(jitted._cache_size() for jitted in list(self._jits.values()))
