"""Watching peer nodes over the side channel: who is dead, and who was replaced by a new instance.

Both roles use it: the decode node watches the prefill side-channel addresses it pulls from, the prefill node the
decode addresses it serves. Every ``interval_s`` (one ``tick``) the monitor pings each watched address; the peer's
side channel answers with a pong. Any message from the peer counts, not only pongs. An address from which nothing
was heard during ``max_failures`` intervals in a row is declared dead once: ``on_dead(addr)`` runs and the address
stops being watched. A peer killed just after answering is therefore declared dead between ``max_failures`` and
``max_failures + 1`` intervals later (1 s and 2 by default: 2 to 3 s).

Every message names its sender's ``instance``. When a message from a watched address shows an instance other than
the one known there, the peer restarted: ``on_instance_changed(addr, old, new)`` runs at once, the new instance is
watched from then on, and messages still arriving from the old one (late, reordered) are ignored rather than taken
for a second change.

Time. The monitor never reads a clock itself. Given ``clock`` (``RealClock`` or ``VirtualClock`` from
``fsm_pd.effects.clock``: ``now``, ``call_at``, ``cancel``), ``start()`` ticks it every ``interval_s`` of that
clock; given ``clock=None``, the owner calls ``tick()``. A tick never blocks: pings go out through
``SideChannel.ping``, which does not wait for the peer.

Callbacks run on the thread that noticed: the timer's (``on_dead``) or the side-channel listener's
(``on_instance_changed``). They must hand work off (submit events), not do it; an exception in one is logged.

The wiring decides what a death or a restart means for rooms (fail those bound to the address or the old instance)
and what to forget (``PrefillResolver.forget_peer``, ``SideChannel.forget_peer``, the transfer backend's
connection).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from fsm_pd.transport.messages import Message

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 1.0
DEFAULT_MAX_FAILURES = 2
RETIRED_PER_ADDRESS = 8  # old instances remembered per address, so their late messages are recognised


class PingPort(Protocol):
    """What the monitor needs from a side channel (``SideChannel`` has both; a simulated network can too)."""

    def ping(self, addr: str) -> None: ...

    def add_observer(self, observer: Callable[[Message], None]) -> None: ...

    def remove_observer(self, observer: Callable[[Message], None]) -> None: ...


class TimerPort(Protocol):
    def now(self) -> float: ...

    def call_at(self, when: float, callback: Callable[[], None]) -> int: ...

    def cancel(self, handle: int) -> None: ...


@dataclass
class _Watch:
    instance: str | None  # None until the peer's first message (or the caller) says
    heard: bool = False  # something from this instance arrived since the last tick
    misses: int = 0  # ticks in a row with nothing heard
    retired: deque[str] = field(default_factory=lambda: deque(maxlen=RETIRED_PER_ADDRESS))


class PeerMonitor:
    def __init__(self, channel: PingPort, *, clock: TimerPort | None,
                 on_dead: Callable[[str], None],
                 on_instance_changed: Callable[[str, str, str], None] | None = None,
                 interval_s: float = DEFAULT_INTERVAL_S, max_failures: int = DEFAULT_MAX_FAILURES):
        if not interval_s > 0 or max_failures < 1:
            raise ValueError(f"heartbeat interval must be positive and max_failures at least 1, got "
                             f"{interval_s} and {max_failures}")
        self.channel, self.clock = channel, clock
        self.on_dead, self.on_instance_changed = on_dead, on_instance_changed
        self.interval_s, self.max_failures = interval_s, max_failures
        self._watches: dict[str, _Watch] = {}
        self._lock = threading.Lock()
        self._timer: int | None = None
        self._closed = False
        channel.add_observer(self.observe)

    # -- what to watch ----------------------------------------------------------------------------------------------

    def watch(self, addr: str, instance: str | None = None) -> str | None:
        """Watch ``addr`` (idempotent; a new address is pinged at once). ``instance`` is the one the caller expects
        there (from the bootstrap lookup or a message), used until the peer says otherwise. Returns the instance
        known at ``addr`` now; a caller whose expected instance differs is bound to a peer that is gone."""
        with self._lock:
            entry = self._watches.get(addr)
            new = entry is None
            if new:
                entry = self._watches[addr] = _Watch(instance)
            elif entry.instance is None and instance not in entry.retired:
                entry.instance = instance
            known = entry.instance
        if new:  # one ping per address, not one per room bound to it
            self._ping(addr)
        return known

    def unwatch(self, addr: str) -> None:
        with self._lock:
            self._watches.pop(addr, None)

    def watched(self) -> dict[str, str | None]:
        """``{addr: known instance}`` for every watched address."""
        with self._lock:
            return {addr: entry.instance for addr, entry in self._watches.items()}

    def suspect(self, addr: str) -> bool:
        """Whether what is known of the process at ``addr`` is in doubt: it missed its last heartbeat (it may be
        dead, not yet declared so), or nobody watches it, so a death or restart there would go unnoticed (it was
        declared dead, or no room bound to it since it was looked up: every room that waited for the lookup ended
        first)."""
        with self._lock:
            entry = self._watches.get(addr)
            return entry is None or entry.misses > 0

    def instance_of(self, addr: str) -> str | None:
        with self._lock:
            entry = self._watches.get(addr)
            return None if entry is None else entry.instance

    # -- what was heard ---------------------------------------------------------------------------------------------

    def observe(self, msg: Message) -> None:
        """Note a delivered message (the side channel calls this for every one, on its listener thread)."""
        changed = None
        with self._lock:
            if self._closed:
                return
            entry = self._watches.get(msg.origin)
            if entry is None or msg.instance in entry.retired:
                return
            if entry.instance is not None and entry.instance != msg.instance:
                changed = entry.instance
                entry.retired.append(changed)
                entry.misses = 0
            entry.instance = msg.instance
            entry.heard = True
        if changed is not None:
            log.warning("peer at %s is a new instance (%s, was %s): it restarted", msg.origin, msg.instance, changed)
            self._safely(self.on_instance_changed, msg.origin, changed, msg.instance)

    # -- time -------------------------------------------------------------------------------------------------------

    def tick(self) -> list[str]:
        """One heartbeat interval has passed: count misses, declare the dead, ping the rest. Returns the dead."""
        dead = []
        with self._lock:
            for addr, entry in list(self._watches.items()):
                entry.misses = 0 if entry.heard else entry.misses + 1
                entry.heard = False
                if entry.misses >= self.max_failures:
                    dead.append(addr)
                    del self._watches[addr]
            alive = list(self._watches)
        for addr in dead:
            log.warning("peer at %s missed %d heartbeats: declaring it dead", addr, self.max_failures)
            self._safely(self.on_dead, addr)
        for addr in alive:
            self._ping(addr)
        return dead

    def start(self) -> PeerMonitor:
        """Tick every ``interval_s`` of ``clock`` until ``close``."""
        if self.clock is None:
            raise RuntimeError("a PeerMonitor without a clock is ticked by its owner: call tick()")
        with self._lock:
            if self._timer is None and not self._closed:
                self._timer = self.clock.call_at(self.clock.now() + self.interval_s, self._fire)
        return self

    def _fire(self) -> None:
        self.tick()
        with self._lock:
            # armed from the time of firing, not the schedule: a node that was stopped does not burst-tick on resume
            if not self._closed:
                self._timer = self.clock.call_at(self.clock.now() + self.interval_s, self._fire)

    def close(self) -> None:
        """Stop ticking and observing. Idempotent; the side channel is left open (it is not ours)."""
        with self._lock:
            self._closed = True
            timer, self._timer = self._timer, None
        if timer is not None:
            self.clock.cancel(timer)
        self.channel.remove_observer(self.observe)

    # -- helpers ----------------------------------------------------------------------------------------------------

    def _ping(self, addr: str) -> None:
        try:
            self.channel.ping(addr)
        except Exception as exc:  # noqa: BLE001 - a bad address or a closing channel: the peer just goes unheard
            log.debug("cannot ping %s: %s", addr, exc)

    def _safely(self, callback: Callable[..., None] | None, *args: str) -> None:
        if callback is None:
            return
        try:
            callback(*args)
        except Exception:
            log.exception("peer monitor callback %s%r raised", getattr(callback, "__name__", callback), args)
