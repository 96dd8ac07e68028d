"""Clocks that fire deadline timers: a real one for servers, a virtual one for the simulation and tests.

Both hand out a handle per timer; ``cancel`` is best effort. The machines ignore a ``timeout`` for a timer that is
no longer armed, so a timer that fires just after being cancelled is harmless.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable


class VirtualClock:
    """Time moves only when told to; timers fire in (time, arming order), so runs are deterministic."""

    def __init__(self, start: float = 0.0):
        self._now = start
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._cancelled: set[int] = set()
        self._ids = itertools.count()

    def now(self) -> float:
        return self._now

    def call_at(self, when: float, callback: Callable[[], None]) -> int:
        handle = next(self._ids)
        heapq.heappush(self._heap, (when, handle, callback))
        return handle

    def cancel(self, handle: int) -> None:
        self._cancelled.add(handle)

    def next_time(self) -> float | None:
        while self._heap and self._heap[0][1] in self._cancelled:
            self._cancelled.discard(heapq.heappop(self._heap)[1])
        return self._heap[0][0] if self._heap else None

    def fire_next(self) -> bool:
        """Advance to the earliest pending timer and fire every timer due at that instant."""
        when = self.next_time()
        if when is None:
            return False
        self._now = max(self._now, when)
        while self._heap and self._heap[0][0] <= self._now:
            _, handle, callback = heapq.heappop(self._heap)
            if handle in self._cancelled:
                self._cancelled.discard(handle)
                continue
            callback()
        return True


class RealClock:
    """Wall-clock timers serviced by one daemon thread (not a thread per timer)."""

    def __init__(self):
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._cancelled: set[int] = set()
        self._ids = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="fsm-pd-timers", daemon=True)
        self._thread.start()

    def now(self) -> float:
        return time.time()

    def call_at(self, when: float, callback: Callable[[], None]) -> int:
        with self._cv:
            handle = next(self._ids)
            heapq.heappush(self._heap, (when, handle, callback))
            self._cv.notify()
        return handle

    def cancel(self, handle: int) -> None:
        with self._cv:
            self._cancelled.add(handle)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (not self._heap or self._heap[0][0] > time.time()):
                    self._cv.wait(None if not self._heap else max(0.0, self._heap[0][0] - time.time()))
                if self._closed:
                    return
                _, handle, callback = heapq.heappop(self._heap)
                if handle in self._cancelled:
                    self._cancelled.discard(handle)
                    continue
            callback()
