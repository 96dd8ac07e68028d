"""The OS's randomness, drawn a few KiB at a time: ids that must not repeat (side-channel nonces, transfer uuids),
without a system call each.

``secrets.randbits`` reads ``os.urandom`` every call, and that call lets go of the interpreter's lock. On the model
thread of ``--role pd``, which decides a handoff's transitions between engine steps (``NodeLoop.run_pending``), every
let-go handed the lock to the event loop's thread, and getting it back cost up to the switch interval: the READY and
PULLED nonces and the transfer uuid took 10% of that thread's handoff time under 16 streams on a loaded CPU (136-280
µs a call, cProfile of ``run_pending``). The values are the same bytes from the same source, drawn in batches: as
unpredictable, and no more likely to repeat. A forked child starts a fresh batch, so it never hands out its parent's
values.
"""

from __future__ import annotations

import os
import threading

BATCH_BYTES = 4096  # 512 values a system call


class RandomBits:
    def __init__(self, batch_bytes: int = BATCH_BYTES) -> None:
        self._batch_bytes = batch_bytes
        self._lock = threading.Lock()
        self._buffer, self._at = b"", 0

    def bits(self, n: int) -> int:
        """A uniformly random int of ``n`` bits (1 to 64)."""
        if not 0 < n <= 64:
            raise ValueError(f"1 to 64 bits, not {n}")
        with self._lock:
            if self._at + 8 > len(self._buffer):
                self._buffer, self._at = os.urandom(self._batch_bytes), 0
            word = int.from_bytes(self._buffer[self._at:self._at + 8], "little")
            self._at += 8
        return word >> (64 - n)

    def forget(self) -> None:
        """Drop what is left of the batch (a forked child must not reuse its parent's)."""
        self._buffer, self._at = b"", 0


_shared = RandomBits()
os.register_at_fork(after_in_child=_shared.forget)


def random_bits(n: int) -> int:
    """``secrets.randbits(n)`` for ``n`` up to 64, from the process's batch."""
    return _shared.bits(n)
