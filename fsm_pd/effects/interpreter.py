"""Effect interpreters: run a decision's effects through registered handlers, or only record them.

A handler is ``handler(node, room, effect) -> None``. It may start work (a pull on a worker thread, a message on
the side channel) and report results later with ``node.submit(room.room, trigger, payload)``. A handler that raises
never leaves a room stuck: the exception becomes an ``error`` event saying who was at fault.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from fsm_pd.machines.effect_types import ArmTimer, CancelTimer, Effect

if TYPE_CHECKING:
    from fsm_pd.effects.node import Node
    from fsm_pd.machines import Decision, Room

log = logging.getLogger(__name__)

BLAMES = ("local", "remote", "timeout")

Handler = Callable[["Node", "Room", Any], None]


class EffectError(Exception):
    """Raised by a handler to fail the room with a reason and who was at fault."""

    def __init__(self, reason: str, blame: str = "local"):
        if blame not in BLAMES:
            raise ValueError(f"blame must be one of {BLAMES}, got {blame!r}")
        super().__init__(reason)
        self.reason = reason
        self.blame = blame


def arm_timer(node: Node, room: Room, effect: ArmTimer) -> None:
    seconds = room.ctx.get("deadlines", {}).get(effect.timer)
    if seconds is None:
        raise EffectError(f"no deadline configured for timer {effect.timer!r}")
    key = (room.room, effect.timer)
    node.timers[key] = node.clock.call_at(
        node.clock.now() + float(seconds), lambda: node.submit(room.room, "timeout", {"timer": effect.timer})
    )


def cancel_timer(node: Node, room: Room, effect: CancelTimer) -> None:
    handle = node.timers.pop((room.room, effect.timer), None)
    if handle is not None:
        node.clock.cancel(handle)


TIMER_HANDLERS: dict[type[Effect], Handler] = {ArmTimer: arm_timer, CancelTimer: cancel_timer}


class EffectInterpreter:
    """Runs effects through ``handlers`` (plus the standard timer handlers)."""

    def __init__(self, handlers: Mapping[type[Effect], Handler]):
        self.handlers: dict[type[Effect], Handler] = {**TIMER_HANDLERS, **handlers}

    def run(self, node: Node, room: Room, decision: Decision) -> None:
        for effect in decision.effects:
            handler = self.handlers.get(type(effect))
            try:
                if handler is None:
                    raise EffectError(f"no handler registered for {type(effect).__name__}")
                handler(node, room, effect)
            except EffectError as exc:
                node.submit(room.room, "error", {"blame": exc.blame, "reason": exc.reason,
                                                 "effect": type(effect).__name__})
            except Exception as exc:  # a bug in a handler must still end the room
                log.exception("effect %s failed for room %s", type(effect).__name__, room.room)
                node.submit(room.room, "error", {"blame": "local", "reason": f"{type(exc).__name__}: {exc}",
                                                 "effect": type(effect).__name__})


class RecordingInterpreter:
    """Runs nothing; remembers every effect it was handed, in order (replay and tests)."""

    def __init__(self):
        self.calls: list[tuple[int, int, Effect]] = []

    def run(self, node: Node, room: Room, decision: Decision) -> None:
        self.calls.extend((room.room, decision.version, e) for e in decision.effects)
