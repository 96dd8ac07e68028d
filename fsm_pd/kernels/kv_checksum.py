"""The KV checksum of a handoff: crc32c of a room's pages as they sit in a pool, one value per piece and layer.

Both nodes compute it over their own pool, in the same canonical order, so that whatever changed the bytes in
between (the wire, a page of P's pool freed and reused while its send from the pool still ran, a page of D's pool
overwritten after it was written) shows as a mismatch (``docs/data-plane.md``, "The KV checksum"):

* a *part* is the run of KV slots one piece of the resharding plan moves: ``(shard, first_slot, count)`` of the
  pool's device shards (P reads its source slots, D its destination slots; one part, all slots of the one device,
  without tensor parallelism);
* per part and layer, the crc32c of every page in transfer order, each page's bytes ``[page_size, 2 * count,
  head_dim]`` row-major: the bytes that piece's rows of the staging array hold, padding rows left out.

On a CPU device a layer's NumPy view is zero-copy, so the crc reads the pool in place at about the speed of a copy
(crc32c uses the CPU's crc32 instruction: 25 GB/s on the dev VM). On an accelerator that would be a device-to-host
copy of every page, so ``pool_checksums`` returns None there and the handoff goes unchecked (counted on D).

Views of the pool must not outlive the caller's model-thread job (a view alive across the next step's donation makes
XLA copy the pool): they are taken and dropped inside ``pool_checksums``, also when it raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import crc32c
import numpy as np

ALGORITHM = "crc32c"

# (shard, first slot within the shard, slot count): the slots one piece of a handoff moves
Part = tuple[int, int, int]


def layer_shards(layer: Any) -> list[Any] | None:
    """A pool layer's device shards in slot order (axis 2), or None when it is not on CPU devices."""
    if any(device.platform != "cpu" for device in layer.devices()):
        return None
    if len(layer.devices()) == 1:
        return [layer]
    shards = sorted(layer.addressable_shards, key=lambda shard: shard.index[2].start or 0)
    return [shard.data for shard in shards]


def pool_checksums(pool: Sequence[Any], pages: Sequence[int], parts: Sequence[Part]) -> list[list[int]] | None:
    """``[part][layer]`` crc32c of ``pages`` of ``pool`` (one array per layer), or None where the pool is not on
    CPU devices. Run it on the thread that owns the pool (a model-thread job)."""
    out: list[list[int]] = [[] for _ in parts]
    for layer in pool:
        shards = layer_shards(layer)
        if shards is None:
            return None
        for index, part in enumerate(parts):
            out[index].append(_part_crc(shards[part[0]], pages, part))
        del shards
    return out


def _part_crc(shard: Any, pages: Sequence[int], part: Part) -> int:
    host = np.asarray(shard)  # zero-copy on CPU; waits for the pending writes
    try:
        _, first, count = part
        value = 0
        if 2 * count == host.shape[2]:  # whole pages: one call per run of consecutive pages
            flat = host.reshape(host.shape[0], -1).view(np.uint8)
            start = 0
            for i in range(1, len(pages) + 1):
                if i == len(pages) or pages[i] != pages[i - 1] + 1:
                    value = crc32c.crc32c(flat[pages[start] : pages[i - 1] + 1], value)
                    start = i
            return value
        for page in pages:  # a run of slots: each page's slice made contiguous (small: one page)
            value = crc32c.crc32c(np.ascontiguousarray(host[page, :, 2 * first : 2 * (first + count)]), value)
        return value
    finally:
        del host
