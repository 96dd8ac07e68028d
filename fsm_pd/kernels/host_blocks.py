"""Reusable, 64-byte-aligned host blocks, so that page copies and received bytes land in memory already paged in.

Both ends of a transfer write 64 MiB-scale buffers again and again: P gathers a request's pages into a staging
block, D receives the staging bytes into one. Fresh memory costs a first-touch page fault per 4 KiB (~16k per
64 MiB, more than the copy itself on the dev VM), so each keeps the blocks it used and hands one out again once
nothing refers to it.

"Nothing refers to it" is CPython's reference count of the block's owning array. NumPy points every view, however
derived, at the owner, and jax keeps the host array referenced for as long as a device buffer that aliases it (on
CPU, ``device_put`` of an aligned host array is zero-copy) or any NumPy view of that buffer is alive. Only the pool
hands blocks out, and a user can only drop references to a block it was given, so a block seen unreferenced under
the pool lock stays free until the pool hands it out again.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

try:  # jaxlib drops its references to aliased host arrays lazily, at its next dispatch; this does it now
    from jax._src.lib._jax import collect_garbage as _release_deferred
except ImportError:  # pragma: no cover - another jaxlib: a block then waits for the next dispatch to be reusable

    def _release_deferred() -> None:
        pass


ALIGNMENT = 64  # XLA's CPU client aliases (does not copy) host buffers aligned to this in device_put
_IDLE_REFS = 2  # the pool's own list entry + getrefcount's argument


class HostBlocks:
    def __init__(self, max_bytes: int = 1 << 30, *, min_pooled_bytes: int = 1 << 20) -> None:
        """Retain at most ``max_bytes`` of blocks; blocks below ``min_pooled_bytes`` are plain allocations (malloc's
        own free lists keep those warm)."""
        self.max_bytes = max_bytes
        self.min_pooled_bytes = min_pooled_bytes
        self._owners: list[np.ndarray] = []  # memory-owning arrays (``.base is None``)
        self._lock = threading.Lock()

    def block(self, nbytes: int) -> np.ndarray:
        """An uninitialised, aligned ``uint8[nbytes]``, warm when a retained block of a fitting size is idle."""
        if nbytes < self.min_pooled_bytes:
            return _aligned(_new_owner(nbytes), nbytes)
        # Without this, a staging array dropped just before the next request still looks referenced, and every
        # other request would page in a cold block (measured: 64 MiB gathers 11 ms instead of 7).
        _release_deferred()
        with self._lock:
            for i in range(len(self._owners)):
                # Index access only: binding the owner to a local name would add a reference.
                fits = nbytes + ALIGNMENT <= self._owners[i].nbytes <= 2 * nbytes + ALIGNMENT
                if fits and sys.getrefcount(self._owners[i]) == _IDLE_REFS:
                    return _aligned(self._owners[i], nbytes)
            self._drop_idle_until(self.max_bytes - nbytes)
            owner = _new_owner(nbytes)
            if self.retained_bytes() + owner.nbytes <= self.max_bytes:
                self._owners.append(owner)
            return _aligned(owner, nbytes)

    def arrays(self, shapes_dtypes: Sequence[tuple[Sequence[int], object]]) -> list[np.ndarray]:
        """Uninitialised host arrays carved from one block, each ``ALIGNMENT``-aligned."""
        dtypes = [jnp.dtype(dtype) for _, dtype in shapes_dtypes]  # jnp: knows bfloat16 and friends by name
        sizes = [int(np.prod(shape, dtype=np.int64)) * dtype.itemsize for (shape, _), dtype in
                 zip(shapes_dtypes, dtypes, strict=True)]
        offsets, total = [], 0
        for size in sizes:
            offsets.append(total)
            total += -(-size // ALIGNMENT) * ALIGNMENT
        block = self.block(total)
        return [
            block[offset : offset + size].view(dtype).reshape(tuple(shape))
            for offset, size, dtype, (shape, _) in zip(offsets, sizes, dtypes, shapes_dtypes, strict=True)
        ]

    def retained_bytes(self) -> int:
        return sum(o.nbytes for o in self._owners)

    def idle_addresses(self) -> set[int]:
        """Where a block handed out now could start: the aligned start of every idle retained block."""
        _release_deferred()
        with self._lock:
            return {
                _aligned(self._owners[i], 1).ctypes.data
                for i in range(len(self._owners))
                if sys.getrefcount(self._owners[i]) == _IDLE_REFS
            }

    def _drop_idle_until(self, budget: int) -> None:
        """Forget idle blocks (oldest first) until the retained total fits ``budget``."""
        i = 0
        while i < len(self._owners) and self.retained_bytes() > budget:
            if sys.getrefcount(self._owners[i]) == _IDLE_REFS:
                del self._owners[i]
            else:
                i += 1


def _new_owner(nbytes: int) -> np.ndarray:
    return np.empty(nbytes + ALIGNMENT, np.uint8)


def _aligned(owner: np.ndarray, nbytes: int) -> np.ndarray:
    start = -owner.ctypes.data % ALIGNMENT
    return owner[start : start + nbytes]
