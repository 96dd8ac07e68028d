"""libtpu's premapped host buffer: most of what opening a TPU costs a process, and the size a node asks for.

When a process opens a TPU, libtpu maps a buffer of host memory through which small transfers between the host and
the chip go (``TPU_PREMAPPED_BUFFER_SIZE``, default 4 GiB; a transfer larger than
``TPU_PREMAPPED_BUFFER_TRANSFER_THRESHOLD_BYTES``, by default the buffer's size, goes another way). On the v5e host
that mapping was 5.2 s of a 5.7 s open (libtpu's own log, ``TPU_STDERR_LOG_LEVEL=0``: "Starting premapped memory
manager initialization" 0.5 s into the open, "tpu::System initialized" 5.2 s later), and the open holds the
interpreter's lock while it runs (``bench/chip_open.py``), so nothing else of a start moves meanwhile.

A serving process moves little through it: the weights once (arrays of tens of MiB each), a step's inputs and tokens
(bytes), and KV only where a handoff stages through the host (``tcp``, ``zmq``). So a node asks for
``DEFAULT_BYTES`` unless the environment already names a size: a user's own ``TPU_PREMAPPED_BUFFER_SIZE`` always
wins. ``bench/chip_open.py --premapped`` times the open and host copies at several sizes (docs/tpu.md, "Start-up").
"""

from __future__ import annotations

import os

SIZE_ENV = "TPU_PREMAPPED_BUFFER_SIZE"
DEFAULT_BYTES = 256 << 20


def ask_for_buffer(platform: str, environ=os.environ) -> int | None:
    """Set ``TPU_PREMAPPED_BUFFER_SIZE`` to ``DEFAULT_BYTES`` where jax will open a TPU and nobody chose a size; the
    bytes asked for, else None. Must run before jax starts its backend (libtpu reads it once, at the open)."""
    if platform != "tpu" or environ.get(SIZE_ENV):
        return None
    environ[SIZE_ENV] = str(DEFAULT_BYTES)
    return DEFAULT_BYTES
