"""Seeded fault injection for the simulation: what can go wrong, and how often.

One ``fault_rate`` scales every kind of fault; each decision draws from the world's single seeded RNG in event
order, so the same seed gives the same faults at the same moments. Tests can also force faults one at a time.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(slots=True)
class FaultPlan:
    rate: float = 0.0
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    # forced faults, consumed before any random draw (property tests drive these)
    drop_next: int = 0
    fail_next_pull: int = 0
    fail_next_resolve: int = 0

    def __post_init__(self):
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"fault rate must be in [0, 1], got {self.rate}")

    def _draw(self, weight: float) -> bool:
        return self.rate > 0 and self.rng.random() < self.rate * weight

    def message(self) -> str:
        """What happens to one side-channel message: deliver, drop, duplicate or delay."""
        if self.drop_next:
            self.drop_next -= 1
            return "drop"
        if self.rate <= 0:
            return "deliver"
        roll = self.rng.random()
        for kind, weight in (("drop", 0.25), ("duplicate", 0.25), ("delay", 0.25)):
            if roll < self.rate * weight:
                return kind
            roll -= self.rate * weight
        return "deliver"

    def pull_fails(self) -> bool:
        if self.fail_next_pull:
            self.fail_next_pull -= 1
            return True
        return self._draw(0.2)

    def resolve_fails(self) -> bool:
        if self.fail_next_resolve:
            self.fail_next_resolve -= 1
            return True
        return self._draw(0.1)

    def client_abort(self) -> bool:
        return self._draw(0.1)

    def prefill_crash(self) -> bool:
        return self._draw(2.0)
