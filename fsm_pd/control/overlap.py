"""An overlapped handoff: P gathers while its first layers are already on the wire, D writes while the rest arrive.

P side, ``publish_while_gathering``: publish the staging buffer before it is filled, then gather it layer by layer,
advancing the entry after each layer. A layer of the stacked staging array is one contiguous byte range, so "k
layers done" is "k x layer bytes final", which is all a byte stream needs to know.

D side, ``StreamedScatter``. A progressive backend reports, on the pulling thread, how many bytes of the staging
array are final. Once the last byte of a group of layers is in, the group is handed to the model thread as its own
``scatter_layers`` job while later layers are still on the wire; when the pull returns only the last group is left
to write. Groups, not single layers: every write job pays a dispatch and a loop over the pages, so writing one layer
at a time costs more than writing all at once (``python bench/kernels.py``: 1.3-1.75x as long for 1-17 MB).

Why D may write before the pull has finished:

* the bytes of a finished layer never change again, and P's layout was checked against ours before any byte was
  accepted (``pull``'s contract), so a layer is written from exactly what P gathered;
* every write is a job on the model thread, the one FIFO that also frees pages. ``cancel`` is called from the job
  that frees the pages, so a layer that lands after a failure or abort finds the stream cancelled and writes nothing:
  pages are never written after they were given back (SGLang issue 24527);
* a pull that fails half-way leaves some layers of *our own reserved* pages written; the room fails and those pages
  are freed, like any other garbage in a free page.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import Any

import jax
import numpy as np

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


class StreamedScatter:
    """Scatter one pulled staging array ``[L, page_bucket(len(pages)), ...]`` into ``pages``, a group at a time."""

    def __init__(self, model: ModelThread, layout: KVLayout, pages: list[int], sharding: Any = None,
                 group: int | None = None) -> None:
        self.model, self.pages, self.sharding = model, list(pages), sharding
        self.num_layers = layout.num_layers
        row_shape = layout.staging_shape(page_bucket(len(self.pages)))[1:]
        self.layer_bytes = math.prod(row_shape) * np.dtype(layout.dtype).itemsize
        self.group = group or layer_group(layout)
        if self.num_layers % self.group:
            raise ValueError(f"a group of {self.group} layers does not divide {self.num_layers} layers")
        self.submitted = 0  # layers handed to the model thread, always a prefix
        self.cancelled = False  # set and read on the model thread only
        self.error: BaseException | None = None

    @property
    def complete(self) -> bool:
        """Every layer has been handed to the model thread."""
        return self.submitted == self.num_layers

    def on_progress(self, index: int, host: np.ndarray, final_bytes: int) -> None:
        """The backend's ``on_progress`` hook (pulling thread): queue every group of layers that has fully landed."""
        if index != 0:
            return
        landed = min(final_bytes // self.layer_bytes, self.num_layers)
        while self.submitted + self.group <= landed:
            layer = self.submitted
            # Zero-copy on CPU: a 64-byte-aligned slice is aliased, not copied, and it is final from now on.
            staged = jax.device_put(host[layer : layer + self.group], self.sharding)
            self.model.submit(partial(self._write, layer, staged))
            self.submitted += self.group

    def _write(self, layer: int, staged: jax.Array, owner: ModelThread) -> None:
        if self.cancelled or self.error is not None:
            return
        try:
            owner.pool = scatter_layers(owner.pool, layer, staged, self.pages)
        except Exception as exc:  # noqa: BLE001 - reported by finish(), on the room
            self.error = exc

    def written(self, owner: ModelThread) -> None:
        """On the model thread, after every write job: raise the first write's error, else wait for the pool."""
        if self.error is not None:
            raise self.error
        if self.cancelled:
            raise RuntimeError("the streamed scatter was cancelled")
        if not self.complete:
            raise RuntimeError(f"only {self.submitted} of {self.num_layers} layers were handed over")
        jax.block_until_ready(owner.pool)

    def finish(self) -> Future:
        """Queue ``written`` behind every write job; its future resolves once all layers are in the pool."""
        return self.model.submit(self.written)

    def cancel(self) -> None:
        """Call on the model thread before the pages are freed: writes still queued become no-ops."""
        self.cancelled = True
