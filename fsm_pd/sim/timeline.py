"""Work scheduled on the virtual clock, bound to the process instance that owns it.

Everything the simulated ports do later (a message arriving, a pull finishing, a model job running) is a callback
here. A callback owned by an instance that has crashed meanwhile never runs: the process that would have run it is
gone. One owned by an instance that is stalled (``frozen_until``: SIGSTOP, every thread stopped) runs when it
resumes, as a stopped process's timers and threads carry on where they were. ``in_flight`` counts callbacks
that are still work (not deadlines or heartbeats): when it is zero and no node has queued events, the world is
quiet and nothing held can still be let go by work under way.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from fsm_pd.effects import VirtualClock


class Timeline:
    def __init__(self, clock: VirtualClock):
        self.clock = clock
        self.in_flight = 0

    def later(self, delay: float, fn: Callable[[], None], owner: Any = None, *, work: bool = True) -> None:
        """Run ``fn`` ``delay`` virtual seconds from now, unless ``owner`` (an instance) is dead by then."""
        if work:
            self.in_flight += 1

        def fire() -> None:
            if owner is not None and owner.alive and owner.frozen_until > self.clock.now():
                self.clock.call_at(owner.frozen_until, fire)  # still work, and still to run
                return
            if work:
                self.in_flight -= 1
            if owner is None or owner.alive:
                fn()

        self.clock.call_at(self.clock.now() + max(0.0, delay), fire)


class OwnedTimers:
    """``call_at``/``cancel``/``now`` on the virtual clock for one process instance (its ``PeerMonitor``'s timers):
    a timer of an instance that has crashed never fires, as a dead process's timer thread does not."""

    def __init__(self, clock: VirtualClock, owner: Any):
        self.clock, self.owner = clock, owner
        self._handles: dict[int, int] = {}  # our handle -> the clock's (a stalled owner's timer is moved on)
        self._ids = itertools.count(1)

    def now(self) -> float:
        return self.clock.now()

    def call_at(self, when: float, callback: Callable[[], None]) -> int:
        owner, ident, clock = self.owner, next(self._ids), self.clock

        def run() -> None:
            if owner.alive and owner.frozen_until > clock.now():  # stalled: it fires when the process resumes
                self._handles[ident] = clock.call_at(owner.frozen_until, run)
                return
            self._handles.pop(ident, None)
            if owner.alive:
                callback()

        self._handles[ident] = clock.call_at(when, run)
        return ident

    def cancel(self, handle: int) -> None:
        found = self._handles.pop(handle, None)
        if found is not None:
            self.clock.cancel(found)


class _Timer:
    __slots__ = ("handle", "timers")

    def __init__(self, timers: OwnedTimers, handle: int):
        self.timers, self.handle = timers, handle

    def cancel(self) -> None:
        self.timers.cancel(self.handle)


class OwnedDeadlines:
    """The ``HoldClock`` of a simulated transfer server: the real ``HoldTable``'s expiries on the virtual clock,
    owned by the server's process (they die with it) and not counted as work (a hold that nobody pulls is not)."""

    def __init__(self, timers: OwnedTimers):
        self.timers = timers

    def now(self) -> float:
        return self.timers.now()

    def call_at(self, when: float, fn: Callable[[], None]) -> _Timer:
        return _Timer(self.timers, self.timers.call_at(when, fn))
