"""The deadline each live room runs under, kept up to date from the decisions, for the per-state check.

A room has one deadline timer armed at any moment (the machines' rule): the one armed on entering its state, or the
one its state hands over to (the receiver's ``admission``). ``ArmedDeadlines`` records, from each decision that arms
one, which timer it is, since when, and its length (the room's recorded deadlines), and forgets the room when it
ends. A heap ordered by the instant each would become overdue lets ``invariants.overdue_states`` look only at the
rooms whose deadline has passed: scanning every room ever created at every settle point made the simulator
quadratic (34 of 42 s of a 2,000-request run).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Collection
from typing import Any

from fsm_pd.machines.effect_types import ArmTimer

Key = tuple[str, int]  # (instance name, room)


class ArmedDeadlines:
    def __init__(self) -> None:
        self.running: dict[Key, tuple[str, float, float, int]] = {}  # -> (timer, armed at, seconds, arming)
        self._due: list[tuple[float, int, str, int]] = []  # (armed at + seconds, arming, instance, room)
        self._armings = itertools.count()  # tells an arming from a later one at the same instant

    def observe(self, instance: str, room: Any, decision: Any, now: float, node: Any) -> None:
        """A journaled decision of ``instance``'s (``node``): the room runs under the deadline it armed, or, when it
        entered a state without arming one (a broken table), under the one that state should have; none once it
        ended."""
        key = (instance, room.room)
        if room.terminal:
            self.running.pop(key, None)
            return
        timer = next((e.timer for e in decision.effects if type(e) is ArmTimer), None)
        if timer is None and decision.dst != decision.src:
            timer = node.machine.deadlines[decision.dst]
        if timer is None:
            return
        seconds = float(room.ctx.get("deadlines", node.deadlines)[timer])
        arming = next(self._armings)
        self.running[key] = (timer, now, seconds, arming)
        heapq.heappush(self._due, (now + seconds, arming, instance, room.room))

    def overdue(self, now: float, slack: float, alive: Collection[str]) -> list[tuple[Key, str, float, float]]:
        """(key, timer, armed at, seconds) of every room of a live instance that has run under its deadline longer
        than the deadline plus ``slack``; entries of rooms that ended, moved on or died are dropped on the way."""
        due, found = self._due, []
        while due and due[0][0] + slack < now:
            entry = heapq.heappop(due)
            _, arming, instance, room = entry
            running = self.running.get((instance, room))
            if running is not None and running[3] == arming and instance in alive:
                found.append(entry)
        for entry in found:  # still overdue: checked again at the next settle point
            heapq.heappush(due, entry)
        return [((instance, room), *self.running[instance, room][:3]) for _, _, instance, room in found]
