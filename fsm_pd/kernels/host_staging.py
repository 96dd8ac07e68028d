"""A fixed set of preallocated host buffers for device->host staging copies.

Staging arrays can be copied to host memory (to free device memory while a slow peer pulls, or to hand bytes to the
ZMQ fallback). Allocating host memory per request is slow (the OS maps and pins it each time) and unbounded, so the
pool allocates ``num_slots`` buffers of the largest bucket once and hands them out; ``acquire`` blocks for a free
slot up to a timeout and then raises :class:`HostPoolExhausted`, so a stuck peer can only stall requests, never grow
memory. ``copy_to_host`` writes into the slot's buffer in place (the old buffer is donated to the copy).

Memory kind: ``pinned_host`` (page-locked, DMA-able) where every device offers it, else ``unpinned_host``, else the
devices' default memory. jaxlib 0.10.2's CPU backend does list ``pinned_host`` (it is ordinary host memory there).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from fsm_pd.kernels.layout import KVLayout
from fsm_pd.kernels.page_buckets import page_bucket

_HOST_KINDS = ("pinned_host", "unpinned_host")


class HostPoolExhausted(TimeoutError):
    """No host staging slot came free within the timeout."""


def host_memory_kind(devices: list[jax.Device]) -> str:
    """The best host memory kind all ``devices`` offer, or their default memory kind if they offer none."""
    offered = [{memory.kind for memory in device.addressable_memories()} for device in devices]
    for kind in _HOST_KINDS:
        if all(kind in kinds for kinds in offered):
            return kind
    return devices[0].default_memory().kind


@dataclass(eq=False)
class HostSlot:
    """One preallocated host buffer, ``[num_layers, rows, page_size, 2*kv_heads*head_dim]``.

    ``buffer`` is replaced by every copy (the old array is donated); ``staged_rows`` is the row count of the staging
    array last copied in. Rows past it hold older data.
    """

    index: int
    buffer: jax.Array
    pool: HostStagingPool = field(repr=False)
    staged_rows: int = 0


class HostStagingPool:
    """``num_slots`` host buffers, each large enough for the staging array of a ``max_pages``-page request."""

    def __init__(
        self, layout: KVLayout, *, num_slots: int, max_pages: int, sharding: jax.sharding.Sharding | None = None
    ):
        """``sharding`` places the staging arrays that will be copied in (default: the first device, unsharded)."""
        if num_slots < 1:
            raise ValueError(f"num_slots must be at least 1, got {num_slots}")
        self.layout = layout
        self.rows = page_bucket(max_pages)
        sharding = sharding or SingleDeviceSharding(jax.devices()[0])
        self.memory_kind = host_memory_kind(list(sharding.device_set))
        self.sharding = sharding.with_memory_kind(self.memory_kind)
        shape, dtype = layout.staging_shape(self.rows), np.dtype(layout.dtype)
        # device_put rather than a jitted zeros: on jaxlib 0.10.2 a jit output placed by a SingleDeviceSharding in
        # pinned_host loses its host memory space in its type, and the in-place copy below then fails to trace.
        self._slots = [
            HostSlot(index, jax.device_put(np.zeros(shape, dtype), self.sharding), self) for index in range(num_slots)
        ]
        self._free = list(range(num_slots))
        self._held: set[int] = set()
        self._changed = threading.Condition()

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    @property
    def nbytes(self) -> int:
        """Host bytes held by all slots: the pool's whole footprint, fixed at construction."""
        return sum(slot.buffer.nbytes for slot in self._slots)

    def free_slots(self) -> int:
        with self._changed:
            return len(self._free)

    def acquire(self, timeout: float | None) -> HostSlot:
        """Take a free slot, waiting up to ``timeout`` seconds (``None``: forever, ``0``: not at all)."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._free, timeout=timeout):
                raise HostPoolExhausted(
                    f"all {self.num_slots} host staging slots are in use and none was released within {timeout}s"
                )
            index = self._free.pop()
            self._held.add(index)
            return self._slots[index]

    def release(self, slot: HostSlot) -> None:
        """Give ``slot`` back. Releasing a slot twice, or one of another pool, raises ``ValueError``."""
        with self._changed:
            self._check_held(slot)
            self._held.remove(slot.index)
            self._free.append(slot.index)
            self._changed.notify()

    @contextmanager
    def slot(self, timeout: float | None) -> Iterator[HostSlot]:
        """``acquire`` for the duration of a ``with`` block, released even if the block raises."""
        slot = self.acquire(timeout)
        try:
            yield slot
        finally:
            self.release(slot)

    def _check_held(self, slot: HostSlot) -> None:
        if slot.pool is not self or self._slots[slot.index] is not slot:
            raise ValueError(f"host slot {slot.index} belongs to another pool")
        if slot.index not in self._held:
            raise ValueError(f"host slot {slot.index} is not acquired (released twice, or never acquired)")


@cache
def _row_writer(sharding: jax.sharding.Sharding):
    """A jitted ``buffer[:, :rows] = staging`` that donates ``buffer`` and keeps it in ``sharding`` (and its memory)."""

    def write(buffer: jax.Array, staging: jax.Array) -> jax.Array:
        # buffer: [L, slot_rows, ps, 2HD] in host memory; staging: [L, rows <= slot_rows, ps, 2HD] on device.
        # The operands of one update must share a memory space and sharding, so move staging to the buffer's first;
        # XLA then writes the rows straight into the donated host buffer.
        staging = jax.device_put(staging, sharding)
        return jax.lax.dynamic_update_slice(buffer, staging, (0,) * buffer.ndim)

    return jax.jit(write, donate_argnums=0, out_shardings=sharding)


def copy_to_host(staging: jax.Array, slot: HostSlot) -> HostSlot:
    """Copy ``staging`` ``[L, rows, page_size, 2HD]`` into rows ``[0, rows)`` of the acquired ``slot``'s buffer.

    Compiles once per staging bucket. Raises ``ValueError`` if the slot is not held or the staging does not fit.
    """
    pool = slot.pool
    with pool._changed:
        pool._check_held(slot)
    shape, slot_shape = tuple(staging.shape), tuple(slot.buffer.shape)
    if len(shape) != 4 or shape[0] != slot_shape[0] or shape[2:] != slot_shape[2:] or shape[1] > slot_shape[1]:
        raise ValueError(f"staging shape {list(shape)} does not fit a host slot of shape {list(slot_shape)}")
    if np.dtype(staging.dtype) != np.dtype(pool.layout.dtype):
        raise ValueError(f"staging dtype {staging.dtype} does not match the host pool dtype {pool.layout.dtype}")
    writer = _row_writer(pool.sharding)
    slot.buffer = writer(slot.buffer, staging)
    slot.staged_rows = shape[1]
    return slot
