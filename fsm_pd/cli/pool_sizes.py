"""How many KV pages a pool gets on an accelerator when no flag says: a share of the device memory the weights leave.

A node (``--num-pages``) and ``--role pd`` (``--prefill-pages``, ``--decode-pages``) take ``--kv-memory-fraction``
(default 0.8) of the memory free once the weights are on the device, counted in pages as the device stores them
(``LoadedModel.page_bytes_on_device``); the rest is for activations and programs. On a CPU a pool keeps 512 pages.
Before, a node kept 512 pages everywhere: 8,192 tokens of SmolLM2's KV on a 16 GiB TPU v5e, fewer than 16 prompts
of 900 tokens, or 64 streams of 158, while ``--role pd`` beside it took 35,535 pages of the same chip (round r13).
"""

from __future__ import annotations

import argparse
from typing import Any

CPU_POOL_PAGES = 512  # a pool on a CPU, and a node's on a mesh of several devices (--tp): the nodes' old default

FREE_GRANULE_BYTES = 256 * 2**20


def free_granules(free_bytes: int) -> int:
    """``free_bytes`` rounded down to whole 256 MiB: the pool's size, and so every program's shape and its entry in
    the compile cache, must not move with a few MiB. The free memory read before the weights are on the device is
    their size from their shapes; read after, what they took, padded to the chip's tiles: which one a start reads
    depends on how soon its weights arrived. Unrounded, a warm ``--role pd`` on the chip compiled 4 programs again,
    as many as touch the pool (about 12 s of its 19.7 s to ready), where a colocated node, whose pool has a fixed
    size, loaded every one from the cache."""
    return free_bytes // FREE_GRANULE_BYTES * FREE_GRANULE_BYTES


def pool_budget(free_bytes: int, page_bytes: int, fraction: float) -> int:
    """Pages the pools of a device with ``free_bytes`` free may take together (``--kv-memory-fraction``), at
    ``page_bytes`` a page as the device stores it (``LoadedModel.page_bytes_on_device``); ``bench/tpu_compile.py
    --pd`` compiles the programs of a pool this size for a v5e."""
    return int(free_bytes * fraction) // page_bytes


def free_bytes(device) -> int:
    """What the device's memory has free now."""
    stats = device.memory_stats()
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0)


def free_after_weights(device, model: Any, reading: Any = None) -> int:
    """The device's free memory in whole granules once ``model``'s weights are on it: read now, or, while they are on
    their way (``reading``, ``meanwhile.py``), what they will leave."""
    return free_granules(reading.free_bytes(device) if reading is not None and reading.handed is model
                         else free_bytes(device))


def node_pages(args: argparse.Namespace, model: Any, reading: Any = None) -> tuple[int, str]:
    """(pages, how they were chosen) for a node's pool: ``--num-pages`` when given; else on one accelerator device,
    ``--kv-memory-fraction`` of what the weights leave free (``reading``: the model being read, ``meanwhile.py``:
    the memory its weights will leave is known before they arrive); else ``CPU_POOL_PAGES``."""
    if args.num_pages is not None:
        return args.num_pages, "--num-pages"
    import jax

    if model.tp is not None:
        return CPU_POOL_PAGES, "tensor parallel: the default size (--num-pages sets it)"
    device = model.device or jax.local_devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if not stats or "bytes_limit" not in stats:
        return CPU_POOL_PAGES, f"{device.platform}: the default size"
    free = free_after_weights(device, model, reading)
    page_bytes = model.page_bytes_on_device(args.page_size)
    pages = max(2, pool_budget(free, page_bytes, args.kv_memory_fraction))
    return pages, (f"{device.platform}: {args.kv_memory_fraction:g} of {free / 2**30:.2f} GiB free after the "
                   f"weights ({page_bytes} bytes a page)")
