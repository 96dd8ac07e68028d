"""libtpu's premapped host buffer: most of what opening a TPU costs a process, and the size a node asks for.

When a process opens a TPU, libtpu maps a buffer of host memory through which small transfers between the host and
the chip go (``TPU_PREMAPPED_BUFFER_SIZE``, default 4 GiB; a transfer larger than
``TPU_PREMAPPED_BUFFER_TRANSFER_THRESHOLD_BYTES``, by default the buffer's size, goes another way). On the v5e host
that mapping was 5.2 s of a 5.7 s open (libtpu's own log, ``TPU_STDERR_LOG_LEVEL=0``: "Starting premapped memory
manager initialization" 0.5 s into the open, "tpu::System initialized" 5.2 s later), and the open holds the
interpreter's lock while it runs (``bench/chip_open.py``), so nothing else of a start moves meanwhile.

What the size costs and gives, on the v5e host (``python3 bench/host_buffer.py``, one process per size):

| size | open | 256 MiB up | 8 MiB up | 64 MiB down |
| --- | ---: | ---: | ---: | ---: |
| 4 GiB (libtpu's default) | 5.74 s | 5.87 GB/s | 2.05 ms | 0.95 GB/s |
| 1 GiB | 2.56 s | 6.38 GB/s | 1.98 ms | 0.94 GB/s |
| 256 MiB | 1.18 s | 0.27 GB/s | 2.37 ms | 0.92 GB/s |
| 64 MiB | 1.34 s | 0.27 GB/s | 2.84 ms | 0.34 GB/s |

A copy larger than the buffer goes 20x slower, so the size must hold the largest array a node moves through it: the
weights, which go up one array at a time (SmolLM2's largest, its embedding, is 54 MiB in bfloat16; Qwen3-1.7B's
622 MB), and on a prefill or decode node whose handoff stages through the host (``tcp``, ``zmq``) a request's KV,
which grows with its length. So a colocated node, or a ``--role pd`` node whose handoff keeps the KV on the devices
(``pool``, ``device``), asks for the smallest power of two from 256 MiB up that holds its largest weight with a
quarter to spare (``buffer_for``: 256 MiB for SmolLM2, its size at the load of round r14), read from the model's file
headers before the open (``model/shapes_on_disk.py``); any other node, or one whose model's shapes cannot be read
so, asks for ``DEFAULT_BYTES`` (1 GiB: 3.2 s off the open, no copy slower). A user's own
``TPU_PREMAPPED_BUFFER_SIZE`` always wins.
"""

from __future__ import annotations

import os

SIZE_ENV = "TPU_PREMAPPED_BUFFER_SIZE"
DEFAULT_BYTES = 1 << 30
MIN_BYTES = 256 << 20  # below it the open is no quicker (1.18 s at 256 MiB, 1.34 at 64) and 64 MiB copies slow down


def buffer_for(largest_bytes: int | None) -> int:
    """The buffer for a node whose largest copy is ``largest_bytes`` (None: not known, ``DEFAULT_BYTES``)."""
    if largest_bytes is None:
        return DEFAULT_BYTES
    size = MIN_BYTES
    while size < largest_bytes * 5 // 4:
        size *= 2
    return size


def ask_for_buffer(platform: str, environ=os.environ, largest_bytes=lambda: None) -> int | None:
    """Set ``TPU_PREMAPPED_BUFFER_SIZE`` where jax will open a TPU and nobody chose a size, to ``buffer_for`` the
    node's largest copy (``largest_bytes()``: called only then, since it reads the model's headers); the bytes asked
    for, else None. Must run before jax starts its backend (libtpu reads it once, at the open)."""
    if platform != "tpu" or environ.get(SIZE_ENV):
        return None
    size = buffer_for(largest_bytes())
    environ[SIZE_ENV] = str(size)
    return size
