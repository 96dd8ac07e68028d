"""The KV pool layout: one declaration shared by the model, the kernels and the transfer handshake.

A pool is a tuple of per-layer arrays, each ``[num_pages, page_size, 2 * kv_heads, head_dim]``, with K and V of one
head interleaved on axis 2 (``[K0, V0, K1, V1, ...]``). That is SGLang-JAX's fused MHA layout with ``packing = 1``:
the packing axis only exists to fill TPU sublanes with sub-32-bit dtypes, and without it the same bytes are a plain
4-D array that the attention code and the kernels can index directly. Page 0 is reserved as the padding page: bucketed
kernels point unused slots at it, so it must never hold a request's KV.

The layout travels in PREPARE and READY and is compared before any pull, because the transfer library checks only
byte sizes (see ``docs/data-plane.md``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

PAD_PAGE = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class KVLayout:
    """Shape, dtype and sharding of one node's KV pool.

    ``shard_axis`` names the mesh axis that splits the KV-head axis (axis 2), or ``None`` for an unsharded pool.
    """

    num_layers: int
    num_pages: int
    page_size: int
    kv_heads: int
    head_dim: int
    dtype: str = "float32"
    shard_axis: str | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_pages", "page_size", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.num_pages < 2:
            raise ValueError("KVLayout.num_pages must be at least 2: page 0 is the reserved padding page")

    @property
    def page_shape(self) -> tuple[int, int, int]:
        """Shape of one page in one layer: ``(page_size, 2 * kv_heads, head_dim)``."""
        return (self.page_size, 2 * self.kv_heads, self.head_dim)

    @property
    def layer_shape(self) -> tuple[int, int, int, int]:
        """Shape of one layer's pool array: ``(num_pages, page_size, 2 * kv_heads, head_dim)``."""
        return (self.num_pages, *self.page_shape)

    @property
    def usable_pages(self) -> int:
        return self.num_pages - 1

    def page_bytes(self) -> int:
        """Bytes of one page across all layers."""
        import numpy as np  # local: keeps this module importable by the sans-IO layers without numpy at import

        size = self.page_size * 2 * self.kv_heads * self.head_dim * np.dtype(self.dtype).itemsize
        return size * self.num_layers

    def staging_shape(self, rows: int) -> tuple[int, int, int, int, int]:
        """Shape of a staging array of ``rows`` pages of every layer: ``(num_layers, rows, *page_shape)``.

        ``rows`` is a bucket (``fsm_pd.kernels.buckets.page_bucket``), not the request's page count: both sides of a
        transfer derive the same shape from the page count without sending it.
        """
        return (self.num_layers, rows, *self.page_shape)

    def pool_spec(self):
        """``PartitionSpec`` of one layer's pool array: the KV-head axis (2) split over ``shard_axis``."""
        from jax.sharding import PartitionSpec  # local: jax is heavy and the sans-IO layers never need this

        return PartitionSpec(None, None, self.shard_axis, None)

    def staging_spec(self):
        """``PartitionSpec`` of a staging array: the pool's spec with the layer axis in front."""
        from jax.sharding import PartitionSpec

        return PartitionSpec(None, *self.pool_spec())

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens (the last page may be partly filled)."""
        return -(-num_tokens // self.page_size)

    def transfer_key(self) -> dict:
        """What must match between sender and receiver for a transfer: everything except the page count."""
        key = asdict(self)
        del key["num_pages"]
        return key

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> KVLayout:
        return cls(**data)
