"""One daemon thread per process that runs callbacks at monotonic deadlines: hold expiry on P, watchdogs on D.

The jax transfer library processes its own expiries lazily (only when new traffic arrives), so backends keep time
themselves. A single thread with a heap is enough: callbacks are short (drop a reference, register a tombstone,
poison a connection) and must not block.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class TimerHandle:
    __slots__ = ("cancelled", "fn", "when")

    def __init__(self, when: float, fn: Callable[[], None]) -> None:
        self.when = when
        self.fn = fn
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True
        self.fn = _noop  # drop references held by the closure now rather than at the deadline


def _noop() -> None:
    pass


SWEEP_MIN = 1024  # heap entries before cancelled ones are swept out (then twice what is left)


class DeadlineScheduler:
    def __init__(self, name: str = "fsm-pd-deadlines") -> None:
        self._name = name
        self._heap: list[tuple[float, int, TimerHandle]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._wakes_at = math.inf  # when the thread looks at the heap next, by its own reckoning (under ``_cond``)
        self._dropped_until = -math.inf  # the latest deadline of a cancelled handle dropped before it was due
        # the thread now sleeps past cancelled deadlines (``_run``), so a heap this long is swept of them at the next
        # push: a hold is nearly always released long before its expiry, and each would stay a minute otherwise
        self._sweep_at = SWEEP_MIN

    @staticmethod
    def now() -> float:
        """The scheduler's clock: ``call_at`` deadlines are in this time."""
        return time.monotonic()

    def call_at(self, when: float, fn: Callable[[], None]) -> TimerHandle:
        """Run ``fn`` on the scheduler thread at monotonic time ``when`` unless cancelled first."""
        handle = TimerHandle(when, fn)
        with self._cond:
            heapq.heappush(self._heap, (when, next(self._seq), handle))
            if len(self._heap) >= self._sweep_at:
                self._sweep()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            elif when < self._wakes_at:  # else the thread looks in time already
                self._wakes_at = when
                self._cond.notify()
        return handle

    def _sweep(self) -> None:
        """Under ``_cond``: drop the cancelled handles, wherever they are in the heap."""
        kept = []
        for entry in self._heap:
            if entry[2].cancelled:
                self._dropped_until = max(self._dropped_until, entry[0])
            else:
                kept.append(entry)
        heapq.heapify(kept)
        self._heap = kept
        self._sweep_at = max(SWEEP_MIN, 2 * len(kept))

    def call_later(self, delay_s: float, fn: Callable[[], None]) -> TimerHandle:
        return self.call_at(time.monotonic() + delay_s, fn)

    def pending(self) -> int:
        with self._cond:
            return sum(not h.cancelled for _, _, h in self._heap)

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    while self._heap and self._heap[0][2].cancelled:
                        self._dropped_until = max(self._dropped_until, heapq.heappop(self._heap)[0])
                    now = time.monotonic()
                    if self._heap and self._heap[0][0] <= now:
                        handle = heapq.heappop(self._heap)[2]
                        break
                    # with only cancelled deadlines left, look again by the latest one's time anyway rather than
                    # sleep until woken: a hold published after it then wakes nobody (each handoff woke it, as its
                    # hold was released before the thread came to look)
                    when = self._heap[0][0] if self._heap else self._dropped_until
                    self._wakes_at = when if when > now else math.inf
                    self._cond.wait(when - now if when > now else None)
            if handle.cancelled:
                continue
            try:
                handle.fn()
            except Exception:  # a failing callback must not stop every other deadline in the process
                log.exception("deadline callback failed")


_scheduler = DeadlineScheduler()


def scheduler() -> DeadlineScheduler:
    """The process-wide scheduler shared by all backends."""
    return _scheduler
