"""An overlapped handoff: P gathers while its first layers are already on the wire, D writes while the rest arrive.

P side, ``publish_while_gathering``: publish the staging buffer before it is filled, then gather it layer by layer,
advancing the entry after each layer. A layer of the stacked staging array is one contiguous byte range, so "k
layers done" is "k x layer bytes final", which is all a byte stream needs to know.

D side, ``StreamedScatter``: a ``LayerStream`` (``layer_stream.py``: which groups of layers to write when, and why
that is safe) whose writes are ``scatter_layers`` jobs on the model thread. With the KV checksum on, it sums the
bytes as they land, on the pulling thread while they are in cache (``on_progress``), instead of reading the written
pages again. Groups, not single layers: every write job pays a dispatch and a loop over the pages, so writing one
layer at a time costs more than writing all at once (``python bench/page_copy.py``: 1.3-1.75x as long for 1-17 MB).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import crc32c
import jax
import numpy as np

from fsm_pd.control.layer_stream import LayerStream
from fsm_pd.kernels import KVLayout, gather_pages_into, page_bucket, scatter_layers, staging_block
from fsm_pd.model.model_thread import ModelThread
from fsm_pd.transport.backends import TransferBackend


def publish_while_gathering(backend: TransferBackend, uuid: int, pool, pages: list[int], layout: KVLayout,
                            hold_timeout_s: float, on_published: Callable[[int], None]) -> None:
    """Publish a warm staging block under ``uuid``, call ``on_published(rows)`` (READY can go out), then fill it
    from ``pages`` of ``pool`` layer by layer. Run it on the thread that owns the pool."""
    block = staging_block(layout, len(pages))
    progress = backend.publish_progressive(uuid, block, hold_timeout_s)
    on_published(block.shape[1])
    layer_bytes = block[0].nbytes
    gather_pages_into(pool, pages, block, on_layer=lambda i: progress.advance((i + 1) * layer_bytes), layout=layout)


# A loop step of a write job copies at least this much (one page of each layer in the group). On the 64 MiB transfer
# bench (128 KiB pages) that is 4 layers, and groups of 4 came out a little ahead of 1, 2 and 8, within noise.
GROUP_PAGE_BYTES = 512 << 10


def layer_group(layout: KVLayout) -> int:
    """Layers per write job: the smallest divisor of the layer count whose pages add up to ``GROUP_PAGE_BYTES``
    (a divisor, so that every job has the same shape and compiles once per bucket)."""
    page_bytes = math.prod(layout.page_shape) * np.dtype(layout.dtype).itemsize
    for group in range(1, layout.num_layers + 1):
        if layout.num_layers % group == 0 and group * page_bytes >= GROUP_PAGE_BYTES:
            return group
    return layout.num_layers


class StreamedScatter(LayerStream):
    """Scatter one pulled staging array ``[L, page_bucket(len(pages)), ...]`` into ``pages``, a group at a time."""

    def __init__(self, model: ModelThread, layout: KVLayout, pages: list[int], sharding: Any = None,
                 group: int | None = None, checksum: bool = False) -> None:
        """``checksum``: take the KV checksum of each group's pages right after writing it (``checksums``)."""
        row_shape = layout.staging_shape(page_bucket(len(pages)))[1:]
        layer_bytes = math.prod(row_shape) * np.dtype(layout.dtype).itemsize
        super().__init__(model, pages, num_layers=layout.num_layers, layer_bytes=layer_bytes,
                         group=group or layer_group(layout))
        self.sharding = sharding
        self.checksum = checksum
        self.data_bytes = len(pages) * math.prod(layout.page_shape) * np.dtype(layout.dtype).itemsize
        self.sums = [0] * layout.num_layers  # per layer, of the bytes landed so far (padding rows left out)
        self.summed = 0  # staging offset: every landed byte before it is in ``sums``
        self.last_job = -1  # the lease's jobs_ended in our last write job
        self.alone = True  # no other job ran between two of our writes

    def stage(self, host: np.ndarray, layer: int) -> jax.Array:
        # Zero-copy on CPU: a 64-byte-aligned slice is aliased, not copied, and it is final from now on.
        return jax.device_put(host[layer : layer + self.group], self.sharding)

    def on_progress(self, index: int, host: np.ndarray, final_bytes: int) -> None:
        # the pulling thread, right after a frame landed in ``host``: sum it while it is in cache (the values
        # ``pool_checksums`` gives for pages holding these bytes), then hand its layers on
        if self.checksum and index == 0 and final_bytes > self.summed:
            flat = host.reshape(-1).view(np.uint8)
            pos = self.summed
            while pos < final_bytes:
                layer, offset = divmod(pos, self.layer_bytes)
                upto = min(final_bytes, layer * self.layer_bytes + self.data_bytes)
                if offset < self.data_bytes:
                    self.sums[layer] = crc32c.crc32c(flat[pos:upto], self.sums[layer])
                    pos = upto
                else:  # padding rows: not summed
                    pos = (layer + 1) * self.layer_bytes
            self.summed = final_bytes
        super().on_progress(index, host, final_bytes)

    def write(self, owner: ModelThread, layer: int, staged: jax.Array) -> None:
        owner.pool = scatter_layers(owner.pool, layer, staged, self.pages)
        if self.checksum:
            self._job(owner)

    def _job(self, owner: ModelThread) -> bool:
        """Note this job; whether it came right after our previous one (no other job, so no other write, between)."""
        ended = owner.lease.jobs_ended
        self.alone = self.alone and (self.last_job < 0 or ended == self.last_job + 1)
        self.last_job = ended
        return self.alone

    def checksums(self, owner: ModelThread) -> list[list[int]] | None:
        """The sums of the bytes as they landed, which the pages hold if every byte landed and no other job ran on
        the model thread since our first write (the model thread is the pool's only writer, and each of our jobs
        wrote its layers from exactly those bytes): else None, and the caller reads the pages again. On a node whose
        model thread interleaves other work (decode steps) that is the common case, and the check then costs one
        more pass over the pages."""
        if not self.checksum or self.summed < self.num_layers * self.layer_bytes or not self._job(owner):
            return None
        return [list(self.sums)]

    def wait(self, owner: ModelThread) -> None:
        jax.block_until_ready(owner.pool)
