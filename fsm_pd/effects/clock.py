"""Clocks that fire deadline timers: a real one for servers, a virtual one for the simulation and tests.

Both hand out a handle per timer; ``cancel`` is best effort. The machines ignore a ``timeout`` for a timer that is
no longer armed, so a timer that fires just after being cancelled is harmless.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from collections.abc import Callable


class TimerHeap:
    """Timers ordered by (time, arming order). Cancelled entries are dropped lazily, and the heap is compacted when
    they are the majority: nearly every deadline is cancelled long before it is due, and keeping them all (with their
    callbacks) would grow memory with the request rate times the deadline."""

    def __init__(self):
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._cancelled: set[int] = set()
        self._ids = itertools.count()
        self.dropped_until = -math.inf  # the latest time of a cancelled entry dropped before it was due

    def push(self, when: float, callback: Callable[[], None]) -> int:
        handle = next(self._ids)
        heapq.heappush(self._heap, (when, handle, callback))
        return handle

    def cancel(self, handle: int) -> None:
        self._cancelled.add(handle)
        if len(self._cancelled) > 64 and 2 * len(self._cancelled) > len(self._heap):
            kept = []
            for entry in self._heap:
                if entry[1] in self._cancelled:
                    self.dropped_until = max(self.dropped_until, entry[0])
                else:
                    kept.append(entry)
            heapq.heapify(kept)
            self._heap = kept
            self._cancelled.clear()

    def next_time(self) -> float | None:
        while self._heap and self._heap[0][1] in self._cancelled:
            when, handle, _ = heapq.heappop(self._heap)
            self._cancelled.discard(handle)
            self.dropped_until = max(self.dropped_until, when)
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: float) -> list[Callable[[], None]]:
        due = []
        while self._heap and self._heap[0][0] <= now:
            _, handle, callback = heapq.heappop(self._heap)
            if handle in self._cancelled:
                self._cancelled.discard(handle)
            else:
                due.append(callback)
        return due

    def __len__(self) -> int:
        return len(self._heap) - len(self._cancelled)


class VirtualClock:
    """Time moves only when told to; timers fire in (time, arming order), so runs are deterministic."""

    def __init__(self, start: float = 0.0):
        self._now = start
        self._timers = TimerHeap()

    def now(self) -> float:
        return self._now

    def call_at(self, when: float, callback: Callable[[], None]) -> int:
        return self._timers.push(when, callback)

    def cancel(self, handle: int) -> None:
        self._timers.cancel(handle)

    def next_time(self) -> float | None:
        return self._timers.next_time()

    def advance_to(self, when: float) -> None:
        """Move time forward to ``when`` without firing anything (the caller fired everything due before it)."""
        self._now = max(self._now, when)

    def fire_next(self) -> bool:
        """Advance to the earliest pending timer and fire every timer due at that instant."""
        when = self._timers.next_time()
        if when is None:
            return False
        self._now = max(self._now, when)
        for callback in self._timers.pop_due(self._now):
            callback()
        return True


class RealClock:
    """Wall-clock timers serviced by one daemon thread (not a thread per timer)."""

    def __init__(self):
        self._timers = TimerHeap()
        # a plain lock, taken directly where nothing is notified (``cancel``): a Condition's own enter and exit are
        # Python calls, and a --role pd handoff cancels four deadlines and arms two
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._closed = False
        self._wakes_at = math.inf  # when the thread looks at the heap next, by its own reckoning (under ``_cv``)
        self._thread = threading.Thread(target=self._run, name="fsm-pd-timers", daemon=True)
        self._thread.start()

    def now(self) -> float:
        return time.time()

    def call_at(self, when: float, callback: Callable[[], None]) -> int:
        with self._lock:
            handle = self._timers.push(when, callback)
            # a wake costs the arming thread the interpreter's lock (the timer thread takes it to look): wake it only
            # for a timer due before it looks anyway. Not "before every pending one": a room's deadline is cancelled
            # as the next is armed, so that woke the thread at nearly every arm, three times a --role pd handoff
            # (with the thread sleeping until the cancelled ones' time, ``_run``)
            if when < self._wakes_at:
                self._wakes_at = when
                self._cv.notify()
        return handle

    def cancel(self, handle: int) -> None:
        with self._lock:
            self._timers.cancel(handle)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._closed:
                    when, now = self._timers.next_time(), time.time()
                    if when is not None and when <= now:
                        break
                    if when is None and self._timers.dropped_until > now:
                        # only cancelled timers were left: look again by the latest one's time anyway, rather than
                        # sleep until woken, so that a deadline armed due after it wakes nobody
                        when = self._timers.dropped_until
                    self._wakes_at = math.inf if when is None else when
                    self._cv.wait(None if when is None else when - now)
                if self._closed:
                    return
                due = self._timers.pop_due(time.time())
            for callback in due:
                callback()
