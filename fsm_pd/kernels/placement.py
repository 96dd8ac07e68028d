"""Where a pool lives: the mesh and partition specs the kernels must keep.

A pool layer is ``[pages, page_size, lanes]`` (``KVLayout.layer_shape``: each KV head's K and V side by side on the
last axis). The kernels copy whole pages, so the page and token axes (0 and 1) must be whole on every device; only
the KV-head axis (2, the lanes) may be split (``KVLayout.shard_axis``). A staging array, ``[layers, rows, page_size,
lanes]``, is then split the same way on its axis 3, and every device copies its own head slice of each page without
talking to the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding


@dataclass(frozen=True, slots=True)
class Placement:
    """A sharded pool's mesh, one layer's spec and the matching staging spec. Hashable: kernels take it as static."""

    mesh: Mesh
    pool_spec: PartitionSpec
    staging_spec: PartitionSpec

    @property
    def staging_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, self.staging_spec)


def pool_placement(pool: Sequence[jax.Array]) -> Placement | None:
    """The pool's placement, or ``None`` for a pool on one device."""
    sharding = pool[0].sharding
    for index, layer in enumerate(pool):
        if layer.sharding != sharding:
            raise ValueError(f"pool layer {index} is placed {layer.sharding}, unlike layer 0 ({sharding})")
    if isinstance(sharding, SingleDeviceSharding):
        return None
    if not isinstance(sharding, NamedSharding):
        raise ValueError(f"a sharded pool needs a NamedSharding, got {sharding}")
    spec = tuple(sharding.spec)  # a layer has 3 axes; a spec may leave trailing ones out
    if any(axis is not None for i, axis in enumerate(spec) if i != 2):
        raise ValueError(f"only the KV-head axis (2) of a pool may be sharded, got {sharding.spec}")
    heads = spec[2] if len(spec) > 2 else None
    # written as compiled programs return them (KVLayout.pool_spec): one sharding object, one compiled kernel
    return Placement(sharding.mesh, PartitionSpec(None, None, heads), PartitionSpec(None, None, None, heads))
