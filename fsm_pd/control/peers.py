"""Rooms bound to the peer process they talk to, failed at once when that process dies or is replaced.

A decode room binds to its prefill node when its lookup resolves (``bootstrap_resolved``: ``prefill_addr`` and, if
the node registered one, ``prefill_instance``); a prefill room binds to its decode node when PREPARE arrives
(``metadata_received``: ``reply_to`` and ``peer_instance``). Binding a room watches that side-channel address with a
``PeerMonitor``, which pings it every heartbeat interval and reads the instance named by every message from it.

- **Dead.** Nothing heard from the address for ``max_failures`` intervals: every room bound to it fails
  (``peer_failed``), whichever instance it was bound to.
- **Replaced.** A message from the address names a new instance (the peer restarted at the same address): the rooms
  bound to the old instance fail at once with a reason that names the restart; rooms of the new one go on.
- **Moved.** The bootstrap server names another process for the rank a cached lookup pointed at (the resolver asks
  afresh as soon as that node misses a heartbeat: ``PrefillResolver.watch_with``): the rooms bound to the old one
  fail at once, the same way. This is how a prefill node restarted at a new address is noticed before its death is.
- **Bound to the living.** A room is bound to the instance the monitor knows at the address, even when its lookup
  named an older one (a lookup that raced a restart): its messages reach the process there now, the one its request
  reached too.

- **Found dead after the room ended.** A room that failed on its own shortly before its peer was found dead (a pull
  that broke off when the prefill process was killed: the room fails at once, the heartbeats take two intervals more)
  is no longer bound, so nothing fails; the node journals a ``peer`` record for it instead (``store/roles.py``), so
  that replay can tell the other side's journal stops because its process died. Rooms that failed within
  ``max_failures + 1`` intervals before the death was declared are remembered for that (at most ``RECENT`` per
  address).

Each time, ``forget(addr, instance, transfer_addrs)`` drops what this process cached about the gone peer (the
resolver's lookup, the side-channel socket, the transfer connections its rooms used), so the next request finds the
new process instead of the dead one: the lesson of SGLang issues 16903 and 34289, where the decode node had to be
restarted after its prefill node was.

Threads. ``observe`` runs on the node loop (it is a ``Node`` observer); ``dead`` and ``replaced`` on the monitor's
timer and on the side-channel listener. The index of bound rooms belongs to this object, under its own lock, so
nothing here reads ``node.rooms`` off the loop; a room is failed by submitting an event, as from any other thread.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fsm_pd.control.peer_monitor import PeerMonitor, PingPort, TimerPort
from fsm_pd.store.roles import PEER_ROLE

if TYPE_CHECKING:
    from fsm_pd.effects import Node
    from fsm_pd.machines import Decision, Room

log = logging.getLogger(__name__)

# role -> (the trigger that binds a room, the context key of the peer's address, the key of its instance)
BINDING = {"decode": ("bootstrap_resolved", "prefill_addr", "prefill_instance"),
           "prefill": ("metadata_received", "reply_to", "peer_instance")}
PEER_NAME = {"decode": "prefill node", "prefill": "decode node"}

Forget = Callable[[str, "str | None", "set[str]"], None]
RECENT = 1024  # rooms that failed on their own, remembered per peer address until its death could be declared


@dataclass
class _Bound:
    instance: str | None  # None while nothing is known of the process at the address
    since: float  # when the room was bound (the node's clock)
    transfer_addr: str | None = None  # decode: where its pull goes, once READY named it
    rid: str | None = None  # the request's id, for the ``peer`` record of a room that ends first


@dataclass(frozen=True)
class _Ended:
    room: int
    instance: str | None
    rid: str | None
    at: float  # when the room failed (the node's clock)


class PeerWatch:
    def __init__(self, node: Node, channel: PingPort, clock: TimerPort | None, *, interval_s: float,
                 max_failures: int, forget: Forget | None = None):
        """``channel``: the side channel (pings out, every delivered message observed). ``clock``: the timers the
        heartbeat ticks on (``None``: the owner calls ``monitor.tick()``)."""
        self.node, self.role = node, node.role
        self.trigger, self.addr_key, self.instance_key = BINDING[self.role]
        self.peer_name = PEER_NAME[self.role]
        self.forget = forget
        self.monitor = PeerMonitor(channel, clock=clock, on_dead=self.dead, on_instance_changed=self.replaced,
                                   interval_s=interval_s, max_failures=max_failures)
        self._lock = threading.Lock()
        self._by_addr: dict[str, dict[int, _Bound]] = {}
        self._addr_of: dict[int, str] = {}
        self._recent: dict[str, deque[_Ended]] = {}  # addr -> rooms bound there that failed on their own lately
        node.observers.append(self.observe)

    def start(self) -> PeerWatch:
        self.monitor.start()
        return self

    def close(self) -> None:
        self.monitor.close()

    # -- the node loop -----------------------------------------------------------------------------------------------

    def observe(self, room: Room, decision: Decision, at: float) -> None:
        if decision.ignored is not None:
            return
        if room.terminal:
            if decision.src != decision.dst:
                self._unbind(room.room, at if decision.dst == "Failed" and decision.trigger != "peer_failed" else None)
            return
        ctx = room.ctx
        if decision.trigger == self.trigger and self.addr_key in ctx:
            self._bind(room.room, ctx[self.addr_key], ctx.get(self.instance_key), ctx.get("rid"))
        elif decision.trigger == "kv_published" and "transfer_addr" in ctx:
            with self._lock:
                bound = self._by_addr.get(self._addr_of.get(room.room, ""), {}).get(room.room)
                if bound is not None:
                    bound.transfer_addr = ctx["transfer_addr"]

    def _bind(self, room_id: int, addr: str, expected: str | None, rid: str | None = None) -> None:
        # bound before watching: a death declared in between then fails this room too instead of missing it
        with self._lock:
            self._by_addr.setdefault(addr, {})[room_id] = _Bound(expected, self.node.clock.now(),
                                                                 rid=None if rid is None else str(rid))
            self._addr_of[room_id] = addr
        known = self.monitor.watch(addr, expected)
        if known is not None and known != expected:
            # the lookup named an instance that is gone (it raced a restart) or none: the room's messages go to the
            # process at the address now, which is the one its request reached, so that is the one it depends on
            with self._lock:
                bound = self._by_addr.get(addr, {}).get(room_id)
                if bound is not None:
                    bound.instance = known

    def _unbind(self, room_id: int, failed_at: float | None = None) -> None:
        """``failed_at``: the room failed on its own then; it is remembered in case its peer is found dead next."""
        with self._lock:
            addr = self._addr_of.pop(room_id, None)
            rooms = self._by_addr.get(addr)
            if rooms is not None:
                bound = rooms.pop(room_id, None)
                if not rooms:
                    del self._by_addr[addr]
                if bound is not None and failed_at is not None:
                    recent = self._recent.setdefault(addr, deque(maxlen=RECENT))
                    while recent and recent[0].at < failed_at - self._declaring_s():  # too old to matter now
                        recent.popleft()
                    recent.append(_Ended(room_id, bound.instance, bound.rid, failed_at))

    def _declaring_s(self) -> float:
        """The longest a peer's death takes to declare after its last message: ``max_failures + 1`` intervals."""
        return self.monitor.interval_s * (self.monitor.max_failures + 1)

    def _lately_failed(self, addr: str, which: Callable[[_Bound], bool]) -> list[_Ended]:
        """Under the lock: the rooms bound to ``addr`` (those ``which`` picks) that failed on their own within the
        time it takes to declare a peer dead; taken, so each is recorded once."""
        recent = self._recent.pop(addr, None)
        if not recent:
            return []
        since = self.node.clock.now() - self._declaring_s()
        return [e for e in recent if e.at >= since and which(_Bound(e.instance, e.at))]

    # -- the monitor's callbacks -------------------------------------------------------------------------------------

    def dead(self, addr: str) -> None:
        monitor = self.monitor
        self._fail(addr, lambda b: True, None,
                   f"{self.peer_name} at {addr} missed {monitor.max_failures} heartbeats {monitor.interval_s:g} s "
                   "apart: it died, hangs or is cut off")

    def moved(self, addr: str, old: str | None, new: str | None) -> None:
        """The bootstrap server names another process for the rank that ``addr`` served (the resolver saw it): the
        node restarted, most likely at another address, and the process at ``addr`` is gone."""
        self._fail(addr, lambda b: old is None or b.instance in (old, None), old,
                   f"{self.peer_name} at {addr} restarted: instance {old} was replaced by {new} in the bootstrap "
                   "server's registry")

    def replaced(self, addr: str, old: str, new: str) -> None:
        # a room bound while nothing was known there was bound to whoever answered first: the old instance
        self._fail(addr, lambda b: b.instance in (old, None), old,
                   f"{self.peer_name} at {addr} restarted: instance {old} was replaced by {new}")

    def _fail(self, addr: str, which: Callable[[_Bound], bool], instance: str | None, reason: str) -> None:
        with self._lock:
            rooms = self._by_addr.get(addr, {})
            gone = {room_id: bound for room_id, bound in rooms.items() if which(bound)}
            for room_id in gone:
                del rooms[room_id]
                del self._addr_of[room_id]
            if not rooms:
                self._by_addr.pop(addr, None)
            ended = self._lately_failed(addr, which)
        if gone:
            log.warning("%s: failing %d room(s): %s", self.node.node_id, len(gone), reason)
        for room_id in sorted(gone):
            self.node.submit(room_id, "peer_failed", {"reason": reason})
        for e in ended:  # failed already (their pull broke off, say): replay reads why the other side went silent
            self.node.record(PEER_ROLE, e.room, "peer_failed", "Failed",
                             {"rid": e.rid, "peer": self.peer_name, "addr": addr, "room_failed_at": e.at},
                             reason=f"peer failed: {reason}")
        if self.forget is not None:
            try:
                self.forget(addr, instance, {b.transfer_addr for b in gone.values() if b.transfer_addr})
            except Exception:  # forgetting is cleanup: the rooms are already failed
                log.exception("%s: forgetting the peer at %s failed", self.node.node_id, addr)

    # -- reading -----------------------------------------------------------------------------------------------------

    def bound(self) -> dict[int, tuple[str, str | None, float]]:
        """``{room: (addr, instance, since)}`` for every unfinished room bound to a peer."""
        with self._lock:
            return {room: (addr, b.instance, b.since) for addr, rooms in self._by_addr.items()
                    for room, b in rooms.items()}

    def bound_count(self) -> int:
        with self._lock:
            return len(self._addr_of)


def manager_forget(resolver: Any, side_channel: Any, backend: Any) -> Forget:
    """What a ``KVManager`` drops about a gone peer: the resolver's cached lookup (decode), the side-channel socket
    and the transfer connections its rooms used."""

    def forget(addr: str, instance: str | None, transfer_addrs: set[str]) -> None:
        forget_peer = getattr(resolver, "forget_peer", None)
        if forget_peer is not None:
            forget_peer(addr, instance)
        side_channel.forget_peer(addr)
        for transfer_addr in sorted(transfer_addrs):
            backend.forget(transfer_addr)

    return forget
