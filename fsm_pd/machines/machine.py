"""A role's ``transitions.Machine``, built from its literal table, and the pure ``fire`` step over one room.

``TransferMachine.fire(room, trigger, payload)`` decides and evolves: it picks the first table row whose guards
pass, moves the room, and returns a :class:`Decision` listing the effects the row asks for. It does no I/O; the
caller journals the decision and only then runs the effects.

The decision is taken from the ``transitions.Machine`` itself: its per-event index of ``Transition`` objects (dest and
``Condition`` objects, in table order) is what ``fire`` walks. We skip the library's callback pipeline on purpose:
callbacks are where I/O creeps in, a raise after the state change is not rolled back, and the library's ``trigger()``
costs six to eight times ``fire`` (measured on the sender's rows, guarded and not). ``tests/unit/test_tables.py`` runs
the same room through the library's own ``trigger()`` (a model whose ``fsm_room`` is the room: what the guards read)
and asserts that both agree on every state, trigger and guard outcome.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from transitions import Machine

from fsm_pd.machines.effect_types import ArmTimer, CancelTimer, Effect, effects_json
from fsm_pd.machines.graph import validate
from fsm_pd.machines.guards import GUARDS
from fsm_pd.machines.states import INITIAL, STATE_NAMES, TERMINAL


@dataclass(slots=True, eq=False)
class Room:
    """One request's transfer on one side: everything a guard may read, rebuilt exactly by replay."""

    room: int
    state: str = INITIAL
    version: int = 0  # number of events journaled for this room (accepted or ignored)
    seen: set[str] = field(default_factory=set)  # triggers accepted so far
    armed: set[str] = field(default_factory=set)  # deadline timers currently armed
    ctx: dict[str, Any] = field(default_factory=dict)  # merged payloads of accepted events
    reason: str | None = None  # why it failed, once Failed

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL


class Decision(NamedTuple):
    """What one event did to one room. A NamedTuple: one is built per event on the hot path."""

    room: int
    version: int
    trigger: str
    src: str
    dst: str
    effects: tuple[Effect, ...]
    effects_json: str
    ignored: str | None = None  # why the event changed nothing, when it did not
    reason: str | None = None  # failure reason, when dst is Failed


@dataclass(frozen=True, slots=True)
class _Row:
    dest: str
    conditions: tuple[tuple[Any, bool], ...]  # (guard function, required truth value)
    effects: tuple[Effect, ...]
    effects_json: str
    arms: frozenset[str]
    cancels: frozenset[str]
    reason: str | None


class _LibraryGuard:
    """Adapts a pure guard ``f(room, payload)`` to the library's ``f(event_data)`` convention."""

    __slots__ = ("guard",)

    def __init__(self, guard):
        self.guard = guard

    def __call__(self, event_data) -> bool:
        return self.guard(event_data.model.fsm_room, event_data.kwargs.get("payload", {}))  # a model holds its room


def failure_reason(trigger: str, payload: Mapping) -> str:
    detail = payload.get("reason")
    if trigger == "timeout":
        return f"{payload.get('timer')} timeout"
    if trigger == "peer_abort":
        return f"aborted by peer: {detail}" if detail else "aborted by peer"
    if trigger == "peer_failed":
        return f"peer failed: {detail}" if detail else "peer failed"
    if trigger == "abort":
        return detail or "aborted"
    if trigger == "error":
        blame = payload.get("blame", "local")
        return f"{blame} error: {detail}" if detail else f"{blame} error"
    return detail or trigger


class TransferMachine:
    """The machine of one role (prefill sender or decode receiver), shared by all of that role's rooms."""

    def __init__(self, role: str, table: Sequence[Mapping], deadlines: Mapping[str, str],
                 handovers: Mapping[str, tuple[str, str]] | None = None):
        """``deadlines``: state -> the timer armed on entering it; ``handovers``: state -> (trigger, the timer that
        trigger's self-loop arms as it cancels the first): see ``graph.py``."""
        validate(table, deadlines, handovers)
        self.role = role
        self.table = table
        self.deadlines = dict(deadlines)
        self.handovers = dict(handovers or {})
        # timer -> the state it guards: every deadline a room of this role may have armed
        self.timer_states = {**{t: s for s, t in self.deadlines.items()},
                             **{t: s for s, (_, t) in self.handovers.items()}}
        self.triggers = tuple(dict.fromkeys(row["trigger"] for row in table))
        self.library = Machine(
            model=None,
            states=list(STATE_NAMES),
            initial=INITIAL,
            transitions=[_library_row(row) for row in table],
            auto_transitions=False,
            send_event=True,
            ignore_invalid_triggers=True,
            name=role,
        )
        self._index = self._compile()

    def _compile(self) -> dict[tuple[str, str], tuple[_Row, ...]]:
        index: dict[tuple[str, str], tuple[_Row, ...]] = {}
        for trigger in self.triggers:
            by_source = self.library.events[trigger].transitions
            for source, compiled in by_source.items():
                rows = [r for r in self.table if r["trigger"] == trigger and r["source"] == source]
                index[(trigger, source)] = tuple(_row(t, r) for t, r in zip(compiled, rows, strict=True))
        return index

    def fire(self, room: Room, trigger: str, payload: Mapping | None = None) -> Decision:
        """Decide and evolve: the one step both the live runtime and replay go through."""
        payload = payload or {}
        version, src = room.version, room.state
        if src in TERMINAL:
            room.version += 1
            return Decision(room.room, version, trigger, src, src, (), "[]", ignored=f"room is already {src}")
        for row in self._index.get((trigger, src), ()):
            for guard, want in row.conditions:
                if guard(room, payload) is not want:
                    break
            else:
                break  # every condition held: this row wins
        else:
            room.version += 1
            return Decision(room.room, version, trigger, src, src, (), "[]", ignored=f"no {trigger} from {src}")
        room.version += 1
        room.state = row.dest
        room.seen.add(trigger)
        room.armed -= row.cancels
        room.armed |= row.arms
        room.ctx.update(payload)
        reason = None
        if row.dest == "Failed":
            reason = room.reason = row.reason or failure_reason(trigger, payload)
            room.armed.clear()
        return Decision(room.room, version, trigger, src, row.dest, row.effects, row.effects_json, reason=reason)


def _library_row(row: Mapping) -> dict:
    converted = {k: row[k] for k in ("trigger", "source", "dest")}
    for key in ("conditions", "unless"):
        if key in row:
            converted[key] = [_LibraryGuard(GUARDS[name]) for name in row[key]]
    return converted


def _row(compiled, row: Mapping) -> _Row:
    conditions = tuple((c.func.guard, c.target) for c in compiled.conditions)
    effects = row["effects"]
    return _Row(
        dest=compiled.dest,
        conditions=conditions,
        effects=effects,
        effects_json=effects_json(effects),
        arms=frozenset(e.timer for e in effects if isinstance(e, ArmTimer)),
        cancels=frozenset(e.timer for e in effects if isinstance(e, CancelTimer)),
        reason=row.get("reason"),
    )
