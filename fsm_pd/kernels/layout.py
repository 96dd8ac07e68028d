"""The KV pool layout: one declaration shared by the model, the kernels and the transfer handshake.

A pool is a tuple of per-layer arrays, each ``[num_pages, page_size, 2 * kv_heads * head_dim]``: one row per token,
holding K and V of each head side by side (``[K0, V0, K1, V1, ...]``, ``head_dim`` values each). Those are the bytes
of SGLang-JAX's fused MHA layout ``[pages, page_size, 2 * kv_heads, head_dim]`` (``packing = 1``), with the last two
axes as one. Why one axis: a TPU lays the last two axes of an array out in tiles of (8 or 16) x 128, so SmolLM2's
``(6, 64)`` per token would be padded to a whole tile, several times its bytes, in HBM and in every copy, while
pages of rows of ``6 * 64 = 384`` values fill their tiles exactly (``docs/tpu.md`` has the measured footprints).
The per-head view is a reshape wherever it is needed (``kv_view``). Page 0 is reserved as the padding page: bucketed
kernels point unused slots at it, so it must never hold a request's KV.

The layout travels in PREPARE and READY and is compared before any pull, because the transfer library checks only
byte sizes (see ``docs/data-plane.md``).

Under tensor parallelism (``tp`` > 1) the pool is split on axis 2 over ``tp`` devices, one block of *KV slots* per
device (a slot is one head's K and V: ``2 * head_dim`` values of a row, ``slot_lanes``). ``kv_slot_heads`` says
which of the model's KV heads each slot holds: every head once when ``tp`` divides ``kv_heads``, each head copied
``tp / kv_heads`` times when ``kv_heads`` divides ``tp`` (SGLang replicates them the same way), and zero-filled
padding heads added first when neither divides (SmolLM2's 3 KV heads on 2 devices).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

PAD_PAGE = 0
PAD_HEAD = -1  # in ``kv_slot_heads``: a padding slot, all zeros, that no query reads

# Tokens per page a pool gets unless told otherwise (``--page-size``), by the platform of its devices. On a TPU v5e
# the decode kernel (``model/decode_attention.py``) was never the slowest at 64, of 16, 64 and 128
# (``docs/tpu-rounds.md``, "Page size"): larger pages mean fewer DMAs, but round each sequence up further. 64 becomes
# the chip's default once a whole node's step has been measured at each size there (``bench/tpu.py --page-sizes``),
# the kernel being the chip's default attention now (``attention.kernels_for``); until then every platform keeps 16
# (``model.md``).
# A prefill and a decode node must agree on it: the handoff refuses a peer whose page size differs.
PAGE_SIZES: dict[str, int] = {}  # platform -> its own default, where it differs
DEFAULT_PAGE_SIZE = 16


def default_page_size(platform: str) -> int:
    """The page size of a pool on ``platform`` ("cpu", "tpu", ...: ``jax.Device.platform``)."""
    return PAGE_SIZES.get(platform, DEFAULT_PAGE_SIZE)


def slot_lanes(head_dim: int, first: int, count: int) -> slice:
    """Where KV slots ``first .. first + count`` sit on the last axis of a pool row (each slot: K then V)."""
    return slice(2 * head_dim * first, 2 * head_dim * (first + count))


def kv_view(rows, head_dim: int):
    """``rows: [..., 2 * slots * head_dim]`` viewed per slot: ``[..., slots, 2, head_dim]`` (K at 0, V at 1)."""
    return rows.reshape(*rows.shape[:-1], rows.shape[-1] // (2 * head_dim), 2, head_dim)


def kv_slot_heads(kv_heads: int, tp: int) -> tuple[int, ...]:
    """The model KV head each KV slot of a pool split ``tp`` ways holds, in slot order (``PAD_HEAD``: padding).

    Slot ``s`` lives on shard ``s // (len(slots) // tp)``. The heads are padded to the smallest count that ``tp``
    divides or that divides ``tp``, then each is copied ``tp // padded`` times (at least once), copies side by side.
    """
    if not isinstance(tp, int) or tp < 1 or not isinstance(kv_heads, int) or kv_heads < 1:
        raise ValueError(f"kv_slot_heads needs positive ints, got kv_heads={kv_heads!r}, tp={tp!r}")
    padded = kv_heads
    while padded % tp and tp % padded:
        padded += 1
    heads = [*range(kv_heads), *[PAD_HEAD] * (padded - kv_heads)]
    copies = max(1, tp // padded)
    return tuple(head for head in heads for _ in range(copies))


@dataclass(frozen=True, slots=True, kw_only=True)
class KVLayout:
    """Shape, dtype and sharding of one node's KV pool.

    ``shard_axis`` names the mesh axis that splits the KV-head axis (axis 2), or ``None`` for an unsharded pool.
    ``kv_heads`` is the model's KV head count; ``tp`` is how many devices the pool's KV slots are split over
    (``kv_slot_heads``), so axis 2 holds ``2 * len(slot_heads)`` rows.
    """

    num_layers: int
    num_pages: int
    page_size: int
    kv_heads: int
    head_dim: int
    dtype: str = "float32"
    shard_axis: str | None = None
    tp: int = 1

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_pages", "page_size", "kv_heads", "head_dim", "tp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.num_pages < 2:
            raise ValueError("KVLayout.num_pages must be at least 2: page 0 is the reserved padding page")
        if self.tp > 1 and self.shard_axis is None:
            raise ValueError(f"KVLayout.tp={self.tp} needs a shard_axis: the pool is split over that mesh axis")

    @property
    def slot_heads(self) -> tuple[int, ...]:
        """The model KV head of each KV slot on axis 2 (``kv_slot_heads``); ``(0, 1, ...)`` when ``tp`` is 1."""
        return kv_slot_heads(self.kv_heads, self.tp)

    @property
    def slots(self) -> int:
        """KV slots per page and layer, padding and copies included: axis 2 has ``2 * slots`` rows."""
        return len(self.slot_heads)

    @property
    def page_shape(self) -> tuple[int, int]:
        """Shape of one page in one layer: ``(page_size, 2 * slots * head_dim)``."""
        return (self.page_size, 2 * self.slots * self.head_dim)

    @property
    def layer_shape(self) -> tuple[int, int, int]:
        """Shape of one layer's pool array: ``(num_pages, page_size, 2 * slots * head_dim)``."""
        return (self.num_pages, *self.page_shape)

    def slot_lanes(self, first: int, count: int) -> slice:
        """Where KV slots ``first .. first + count`` sit on a row's last axis."""
        return slot_lanes(self.head_dim, first, count)

    def page_bytes(self) -> int:
        """Bytes of one page across all layers."""
        import numpy as np  # local: keeps this module importable by the sans-IO layers without numpy at import

        size = self.page_size * 2 * self.slots * self.head_dim * np.dtype(self.dtype).itemsize
        return size * self.num_layers

    def staging_shape(self, rows: int) -> tuple[int, int, int, int]:
        """Shape of a staging array of ``rows`` pages of every layer: ``(num_layers, rows, *page_shape)``.

        ``rows`` is a bucket (``page_buckets.page_bucket``), not the request's page count: both sides of a
        transfer derive the same shape from the page count without sending it.
        """
        return (self.num_layers, rows, *self.page_shape)

    def pool_spec(self):
        """``PartitionSpec`` of one layer's pool array: the KV-head axis (2) split over ``shard_axis``. Written the
        way compiled programs return it (no trailing ``None``), so a pool keeps one sharding object through steps."""
        from jax.sharding import PartitionSpec  # local: jax is heavy and the sans-IO layers never need this

        return PartitionSpec(None, None, self.shard_axis)

    def staging_spec(self):
        """``PartitionSpec`` of a staging array: the pool's spec with the layer axis in front."""
        from jax.sharding import PartitionSpec

        return PartitionSpec(None, *self.pool_spec())

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens (the last page may be partly filled)."""
        return -(-num_tokens // self.page_size)

    def transfer_key(self) -> dict:
        """What must match between sender and receiver for a transfer: everything except the page count and how
        the pool is split over devices (a handoff between different ``tp`` reshards: ``transport/reshard.py``)."""
        key = asdict(self)
        for local in ("num_pages", "shard_axis", "tp"):
            del key[local]
        return key

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> KVLayout:
        return cls(**data)
