"""``JaxKV``: the real ``PrefillKV`` and ``DecodeKV`` ports, the page kernels over the pool the model thread owns.

This is the only control-plane module the effect handlers reach jax through, which keeps jax out of the handlers
and out of the simulation that runs them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from fsm_pd.control.overlap import StreamedScatter, publish_while_gathering
from fsm_pd.kernels import KVLayout, gather_pages, page_bucket, resolve_impl, scatter_pages


class JaxKV:
    def __init__(self, layout: KVLayout, model: Any, *, progressive: bool, sharding: Any = None):
        """``progressive``: the transfer backend streams host bytes, so copies may overlap the wire."""
        self.layout, self.model, self.sharding = layout, model, sharding
        self.progressive = progressive
        self._stream_layers: bool | None = None  # decided at the first pull: a prefill node never asks

    # --- prefill ---
    def gather(self, owner: Any, pages: list[int]) -> jax.Array:
        staging = gather_pages(owner.pool, pages, layout=self.layout)
        staging.block_until_ready()
        return staging

    def gathers_progressively(self, owner: Any) -> bool:
        return resolve_impl(owner.pool) == "cpu"

    def publish_while_gathering(self, owner: Any, transfer: Any, uuid: int, pages: list[int], hold_timeout_s: float,
                                on_published: Callable[[int], None]) -> None:
        publish_while_gathering(transfer, uuid, owner.pool, pages, self.layout, hold_timeout_s, on_published)

    # --- decode ---
    def pull_spec(self, page_count: int) -> tuple[jax.ShapeDtypeStruct]:
        shape = self.layout.staging_shape(page_bucket(page_count))
        return (jax.ShapeDtypeStruct(shape, self.layout.dtype, sharding=self.sharding),)

    @property
    def stream_layers(self) -> bool:
        """D writes layers as they land only on a pool on one CPU device (see overlap.py)."""
        if self._stream_layers is None:
            pool = self.model.pool
            self._stream_layers = self.progressive and pool is not None and resolve_impl(pool) == "cpu"
        return self._stream_layers

    def stream(self, pages: list[int]) -> StreamedScatter | None:
        if not self.stream_layers:
            return None
        return StreamedScatter(self.model, self.layout, list(pages), self.sharding)

    def complete_stream(self, stream: StreamedScatter, staging: jax.Array) -> bool:
        if not stream.submitted:
            return False  # nothing landed early: one whole scatter is cheaper
        stream.on_progress(0, np.asarray(staging), staging.nbytes)  # whatever the pull's last report left
        return True

    def scatter(self, owner: Any, staging: jax.Array, pages: list[int], stream: StreamedScatter | None) -> None:
        if stream is not None:
            stream.written(owner)
            return
        owner.pool = scatter_pages(owner.pool, staging, pages, layout=self.layout)
        jax.block_until_ready(owner.pool)

    def cancel(self, stream: StreamedScatter) -> None:
        stream.cancel()

    def discard(self, staging: Any) -> None:
        """Dropping our reference is enough: a pulled array may alias a warm host block that its backend reuses."""
