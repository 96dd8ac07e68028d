"""Seeded fault injection for the simulation: what can go wrong, and how often.

One ``rate`` scales every kind of random fault; each decision draws from the world's single seeded RNG in event
order, so the same seed gives the same faults at the same moments. Tests (the property suite) also force faults one
at a time: forced ones are used before any random draw.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

MESSAGE_FATES = ("drop", "duplicate", "delay", "reorder")


@dataclass(slots=True)
class FaultPlan:
    rate: float = 0.0
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    forced_messages: deque = field(default_factory=deque)  # fates for the next messages, in order
    fail_next_pull: int = 0
    fail_next_resolve: int = 0
    corrupt_next_pull: int = 0
    slow_pulls_s: float = 0.0  # extra time between a pull taking the bytes and reporting them (late completions)

    def __post_init__(self):
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"fault rate must be in [0, 1], got {self.rate}")

    def _draw(self, weight: float) -> bool:
        return self.rate > 0 and self.rng.random() < self.rate * weight

    def message(self) -> str:
        """What happens to one side-channel message: deliver, or one of ``MESSAGE_FATES``."""
        if self.forced_messages:
            return self.forced_messages.popleft()
        if self.rate <= 0:
            return "deliver"
        roll = self.rng.random()
        for kind, weight in (("drop", 0.2), ("duplicate", 0.2), ("delay", 0.2), ("reorder", 0.2)):
            if roll < self.rate * weight:
                return kind
            roll -= self.rate * weight
        return "deliver"

    def pull_fails(self) -> bool:
        if self.fail_next_pull:
            self.fail_next_pull -= 1
            return True
        return self._draw(0.2)

    def pull_breaks_after(self, layers: int) -> int | None:
        """None, or after how many of a pull's ``layers`` its connection is reset (0: before the first byte)."""
        if not self.pull_fails():
            return None
        return self.rng.randrange(layers)

    def pull_reports_late(self) -> float:
        """Extra seconds before a pull that has its bytes reports them."""
        return self.slow_pulls_s + (self.rng.random() * 2.0 if self._draw(0.1) else 0.0)

    def pull_corrupts(self) -> bool:
        """Whether a pull's bytes are changed on the way (a flipped bit the transport did not catch)."""
        if self.corrupt_next_pull:
            self.corrupt_next_pull -= 1
            return True
        return self._draw(0.1)

    def resolve_fails(self) -> bool:
        if self.fail_next_resolve:
            self.fail_next_resolve -= 1
            return True
        return self._draw(0.1)

    def client_abort(self) -> bool:
        return self._draw(0.1)

    def prefill_crash(self) -> bool:
        return self._draw(2.0)

    def stall(self) -> float:
        """0, or how long a node is stopped (SIGSTOP) once during the run: under a heartbeat interval, or long
        enough that its peer declares it dead."""
        return self.rng.choice((0.5, 4.0)) if self._draw(1.0) else 0.0

    def decode_crash(self) -> bool:
        return self._draw(0.5)
