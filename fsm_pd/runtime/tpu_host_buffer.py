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

A copy larger than the buffer goes 20x slower, so the size must hold the largest array a node moves: a model's
weights go up one array at a time (SmolLM2's largest is 57 MB; Qwen3-1.7B's embedding 622 MB), a handoff staged
through the host (``tcp``, ``zmq``) moves a request's pages. So a node asks for ``DEFAULT_BYTES`` (1 GiB: 3.2 s off
the open, no copy slower) unless the environment already names a size: a user's own ``TPU_PREMAPPED_BUFFER_SIZE``
always wins (a model with a larger array: name one that holds it; a small model on a tight start: 256 MiB).
"""

from __future__ import annotations

import os

SIZE_ENV = "TPU_PREMAPPED_BUFFER_SIZE"
DEFAULT_BYTES = 1 << 30


def ask_for_buffer(platform: str, environ=os.environ) -> int | None:
    """Set ``TPU_PREMAPPED_BUFFER_SIZE`` to ``DEFAULT_BYTES`` where jax will open a TPU and nobody chose a size; the
    bytes asked for, else None. Must run before jax starts its backend (libtpu reads it once, at the open)."""
    if platform != "tpu" or environ.get(SIZE_ENV):
        return None
    environ[SIZE_ENV] = str(DEFAULT_BYTES)
    return DEFAULT_BYTES
