"""The ledger: every allocation and every attempt to free it, for the ownership invariants.

Kinds: ``pages`` (a decode room's reservation), ``staging`` (a prefill staging buffer), ``entry`` (a published
transfer entry: production must end it with exactly one ``release`` or ``fail``), ``pulled`` (a decode buffer pulled
and not yet scattered). Every free attempt is recorded, including those that free nothing, so a second attempt is a
violation even where the real code would have shrugged it off; a free of something never allocated is a violation
for the kinds that hold memory. A crashed instance's holdings are freed by its death, once.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass
from typing import Any

KINDS = ("pages", "staging", "entry", "pulled")
MAY_FREE_NOTHING = frozenset({"pages", "entry"})  # FreePages before any grant; fail() of a never-published uuid


@dataclass(slots=True)
class Holding:
    kind: str
    key: Any
    instance: Any  # the process instance that holds it
    room: int
    since: float


class Ledger:
    def __init__(self, clock):
        self.clock = clock
        self.held: dict[tuple[str, Any], Holding] = {}
        self.freed: dict[tuple[str, Any], str] = {}  # -> who freed it first
        self.attempts: Counter[tuple[str, Any]] = Counter()
        self.allocated: Counter[str] = Counter()
        self.violations: list[str] = []
        self.writes = 0
        self._ids = itertools.count(1)

    def new_id(self) -> int:
        """A fresh buffer number, counted per world so that a failing run names the same buffers every time."""
        return next(self._ids)

    def alloc(self, kind: str, key: Any, instance: Any, room: int) -> None:
        ident = (kind, key)
        if ident in self.held or ident in self.freed or self.attempts[ident]:
            self.violations.append(f"{kind} {key!r} (room {room}) allocated twice")
            return
        self.held[ident] = Holding(kind, key, instance, room, self.clock.now())
        self.allocated[kind] += 1

    def free(self, kind: str, key: Any, by: str) -> None:
        ident = (kind, key)
        self.attempts[ident] += 1
        if self.attempts[ident] > 1:
            first = self.freed.get(ident, "an attempt that freed nothing")
            self.violations.append(f"{kind} {key!r} freed twice: first by {first}, again by {by}")
            return
        holding = self.held.pop(ident, None)
        if holding is None:
            if kind not in MAY_FREE_NOTHING:
                self.violations.append(f"{kind} {key!r} freed by {by} but never allocated")
            return
        self.freed[ident] = by

    def crash(self, instance: Any) -> None:
        """The process died: everything it held is gone with it."""
        for ident in [i for i, h in self.held.items() if h.instance is instance]:
            del self.held[ident]
            self.freed[ident] = "the process dying"
            self.attempts[ident] += 1

    def violation(self, text: str) -> None:
        self.violations.append(text)

    def holdings(self, kind: str | None = None) -> list[Holding]:
        return [h for h in self.held.values() if kind is None or h.kind == kind]
