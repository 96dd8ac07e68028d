"""Bounded polling for tests that wait on a condition another thread makes true."""

from __future__ import annotations

import time


def until(predicate, timeout_s: float = 60.0) -> bool:
    """Poll ``predicate`` until it holds or ``timeout_s`` passes; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()
