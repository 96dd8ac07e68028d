"""The KV checksum of a handoff: crc32c of a room's pages as they sit in a pool, one value per piece and layer.

Both nodes compute it over their own pool, in the same canonical order, so that whatever changed the bytes in
between (the wire, a page of P's pool freed and reused while its send from the pool still ran, a page of D's pool
overwritten after it was written) shows as a mismatch (``docs/data-plane.md``, "The KV checksum"):

* a *part* is the run of KV slots one piece of the resharding plan moves: ``(shard, first_slot, count)`` of the
  pool's device shards (P reads its source slots, D its destination slots; one part, all slots of the one device,
  without tensor parallelism);
* per part and layer, the crc32c of every page in transfer order, each page's bytes ``[page_size, 2 * count *
  head_dim]`` row-major: the bytes that piece's rows of the staging array hold, padding rows left out.

On a CPU device a layer's NumPy view is zero-copy, so the crc reads the pool in place at about the speed of a copy
(crc32c uses the CPU's crc32 instruction: 25 GB/s on the dev VM). On an accelerator that would be a device-to-host
copy of every page, so there the value is another function of the same bytes, computed on the device
(``kv_hash.py``, ``kvmix32``); ``algorithm_for`` says which a pool uses, and the name travels with the values.

Views of the pool must not outlive the caller's model-thread job (a view alive across the next step's donation makes
XLA copy the pool): they are taken and dropped inside ``pool_checksums``, also when it raises.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import crc32c
import numpy as np

from fsm_pd.kernels import kv_hash
from fsm_pd.kernels.layout import slot_lanes

CRC32C = "crc32c"
ALGORITHMS = (CRC32C, kv_hash.ALGORITHM)
# a pool on CPU devices: which of the two to use (default crc32c); the tests set it to cover the device hash here
ALGORITHM_ENV = "FSM_PD_KV_CHECKSUM_ALGORITHM"

log = logging.getLogger(__name__)

# (shard, first slot within the shard, slot count): the slots one piece of a handoff moves
Part = tuple[int, int, int]


def algorithm_for(on_cpu: bool, environ: Any = os.environ) -> str:
    """The checksum a pool uses: crc32c on the host for a pool on CPU devices (unless ``ALGORITHM_ENV`` names the
    device hash), the device hash (``kv_hash``) on an accelerator, whatever the variable says."""
    name = environ.get(ALGORITHM_ENV, "").strip() or CRC32C
    if name not in ALGORITHMS:
        raise ValueError(f"{ALGORITHM_ENV}={name!r}: known algorithms are {', '.join(ALGORITHMS)}")
    return name if on_cpu else kv_hash.ALGORITHM


def layer_shards(layer: Any) -> list[Any] | None:
    """A pool layer's device shards in slot order (axis 2), or None when it is not on CPU devices."""
    if any(device.platform != "cpu" for device in layer.devices()):
        return None
    if len(layer.devices()) == 1:
        return [layer]
    shards = sorted(layer.addressable_shards, key=lambda shard: shard.index[2].start or 0)
    return [shard.data for shard in shards]


def pool_checksums(pool: Sequence[Any], pages: Sequence[int], parts: Sequence[Part],
                   head_dim: int, algorithm: str = CRC32C) -> list[list[int]] | None:
    """``[part][layer]`` checksum of ``pages`` of ``pool`` (one array per layer): crc32c (None where the pool is not
    on CPU devices) or the device hash. Run it on the thread that owns the pool (a model-thread job)."""
    if algorithm == kv_hash.ALGORITHM:
        return kv_hash.device_checksums(pool, pages, parts, head_dim)
    if algorithm != CRC32C:
        raise ValueError(f"unknown KV checksum algorithm {algorithm!r}")
    out: list[list[int]] = [[] for _ in parts]
    for layer in pool:
        shards = layer_shards(layer)
        if shards is None:
            return None
        for index, part in enumerate(parts):
            out[index].append(_part_crc(shards[part[0]], pages, part, head_dim))
        del shards
    return out


def _part_crc(shard: Any, pages: Sequence[int], part: Part, head_dim: int) -> int:
    host = np.asarray(shard)  # zero-copy on CPU; waits for the pending writes
    try:
        _, first, count = part
        lanes = slot_lanes(head_dim, first, count)
        value = 0
        if lanes.stop - lanes.start == host.shape[2]:  # whole pages: one call per run of consecutive pages
            flat = host.reshape(host.shape[0], -1).view(np.uint8)
            start = 0
            for i in range(1, len(pages) + 1):
                if i == len(pages) or pages[i] != pages[i - 1] + 1:
                    value = crc32c.crc32c(flat[pages[start] : pages[i - 1] + 1], value)
                    start = i
            return value
        for page in pages:  # a run of slots: each page's slice made contiguous (small: one page)
            value = crc32c.crc32c(np.ascontiguousarray(host[page, :, lanes]), value)
        return value
    finally:
        del host


class SendSums:
    """The checksum of a whole handoff sent straight from the pool (``page_source.PoolPages``), taken by the send
    itself instead of in a pass of its own: each write of the send sums its bytes (a frame at most, 4 MiB by
    default) right before ``sendmsg``, so the kernel's copy into the socket finds them in cache, and no separate pass
    over the pool is made.

    The values are the same as ``pool_checksums``' for one part of all slots: layer by layer, each layer's rows are
    the pages in transfer order, and the padding rows after them are left out.

    Why it is the pool as the publishing job left it, and so still catches a page reused while the send runs: bytes
    are summed only while no job has run since the publishing job (``took`` is called in the send's lease turn). At
    the start of the next job (``PoolLease.before_next_job``), before that job can write a page, ``finish`` sums
    what the send has not reached yet straight from the pool, a cold pass over the rest only. From
    then on the send may read bytes that a job changed, and D's sum of what it received differs from ours."""

    def __init__(self, source: Any, pages: int, done: Any) -> None:
        self.source, self.done = source, done
        self.layers = source.shape[0]
        self.layer_bytes, self.data_bytes = source.layer_bytes, pages * source.page_bytes
        self.end = (self.layers - 1) * self.layer_bytes + self.data_bytes  # the last byte summed, exclusive
        self.values = [0] * self.layers
        self.summed = 0  # staging offset: every byte before it is in ``values``
        self.finished = False
        self._lock = threading.Lock()

    def took(self, start: int, stop: int) -> Callable[[], None] | None:
        """The send is about to read staging bytes ``[start, stop)`` in its lease turn (no job has run since we
        were made, or ``finish`` would have closed us): sum what is new. Returns the delivery to make once the turn
        is over, when this completed the sums."""
        with self._lock:
            if self.finished or start > self.summed or stop <= self.summed:
                return None  # summed already, or a gap (a second stream of the same entry): finish covers it
            self._sum(self.summed, min(stop, self.end))
            return self._finish_locked() if self.summed >= self.end else None

    def finish(self) -> None:
        """Sum the rest from the pool and deliver; under the lease (the start of the next job), at most once."""
        with self._lock:
            if self.finished:
                return
            try:
                self._sum(self.summed, self.end)
                deliver = self._finish_locked()
            except Exception:  # noqa: BLE001 - the decode node then finds no checksum, and says so
                log.exception("the KV checksum of a handoff sent from the pool failed")
                self.finished = True
                deliver = partial(self.done, None)
        deliver()

    def _finish_locked(self) -> Callable[[], None]:
        self.finished = True
        return partial(self.done, [list(self.values)])

    def _sum(self, start: int, stop: int) -> None:
        pos = start
        while pos < stop:
            layer, offset = divmod(pos, self.layer_bytes)
            if offset >= self.data_bytes:  # padding rows: not summed
                pos = (layer + 1) * self.layer_bytes
                continue
            upto = min(stop, layer * self.layer_bytes + self.data_bytes)
            views = self.source.views(pos, upto, limit=1 << 30)
            try:
                for view in views:
                    self.values[layer] = crc32c.crc32c(view, self.values[layer])
            finally:
                views.clear()  # no view of the pool outlives the lease
            pos = upto
        self.summed = max(self.summed, stop)
