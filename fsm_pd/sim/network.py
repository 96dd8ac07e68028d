"""The simulated side channel: the real signed frames over an in-memory network that can misbehave.

A sender's ``SimSideChannel`` stamps a real message (``fsm_pd.transport.messages``) and seals it into the real frame
(``signing.seal``). The network decides its fate with the world's one RNG: delivered after a small latency, dropped,
duplicated, delayed far beyond the deadlines, reordered (a random extra latency), or lost in a partition. The
receiver opens the frame (``open_frame``: MAC and body checks) and runs it through its own ``ReplayGuard`` (fresh per
process instance, as a restarted process's is) before its ``NodeCore`` routes it to a room.

Like the ZMQ channel with ``IMMEDIATE`` and a send timeout, a send to an address where no process listens fails with
``PeerUnreachable`` after ``send_timeout_s``; a frame handed to a live process that dies before it arrives is lost.
A stalled process (SIGSTOP) still has its socket: frames wait in it and arrive when the process resumes, and it
answers no ping meanwhile (as the real channel answers only while its ``healthy`` hook says so). Every frame's fate
that is not a plain delivery is recorded (``World.record``) with what it carried, so that an oracle can tell a
disagreement the faults explain from one they do not.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fsm_pd.sim.faults import FaultPlan
from fsm_pd.sim.timeline import Timeline
from fsm_pd.transport.errors import PeerUnreachable
from fsm_pd.transport.messages import Heartbeat, MalformedMessage, Message
from fsm_pd.transport.replay_guard import ReplayGuard
from fsm_pd.transport.signing import RejectedFrame, open_frame, seal

SEND_TIMEOUT_S = 1.0  # the side channel's default send timeout
LATENCY_S = (0.0002, 0.0005)


@dataclass(eq=False)
class _Endpoint:
    instance: Any
    deliver: Callable[[Any], None]
    guard: ReplayGuard = field(default_factory=ReplayGuard)


class SimNetwork:
    def __init__(self, sched: Timeline, rng: random.Random, plan: FaultPlan, secret: bytes, max_delay_s: float):
        self.sched, self.clock, self.rng, self.plan, self.secret = sched, sched.clock, rng, plan, secret
        self.max_delay_s = max_delay_s  # how late a "delayed" frame may arrive
        self.endpoints: dict[str, _Endpoint] = {}
        self.partitioned_until = float("-inf")
        self.counts: Counter[str] = Counter()
        self.record: Callable[[str, int, str], None] | None = None  # World.record: (kind, room, detail)
        # when a frame of each sender instance last reached a live process: a frame the network delayed can arrive
        # after its sender died, and a peer's monitor counts it as a sign of life (invariants.bound_to_dead_peers)
        self.last_heard: dict[str, float] = {}

    def bind(self, address: str, instance: Any, deliver: Callable[[Any], None]) -> None:
        """``instance`` listens at ``address`` from now on (a restart rebinds the same address)."""
        self.endpoints[address] = _Endpoint(instance, deliver)

    def partition(self, seconds: float) -> None:
        self.partitioned_until = max(self.partitioned_until, self.clock.now() + seconds)
        if self.record is not None:
            self.record("partition", None, f"the network cut for {seconds:g} s", seconds)

    @property
    def partitioned(self) -> bool:
        return self.clock.now() < self.partitioned_until

    def reachable(self, address: str) -> bool:
        found = self.endpoints.get(address)
        return found is not None and found.instance.alive and not self.partitioned

    def transmit(self, sender: Any, address: str, frame: bytes, done: Callable[[BaseException | None], None], *,
                 faults: bool = True, label: tuple[str, int] | None = None) -> None:
        """``faults=False`` (heartbeats): only crashes and partitions touch the frame, as fault injection on real
        processes (``FSM_PD_FAULT_*``) only touches room messages; and they are not work that keeps the world busy."""
        target = self.endpoints.get(address)
        if target is None or not target.instance.alive:
            self.counts["unreachable"] += 1
            self._record("unreachable", label, address)
            error = PeerUnreachable(f"{address}: no live connection within {SEND_TIMEOUT_S * 1000:.0f} ms")
            self.sched.later(SEND_TIMEOUT_S, lambda: done(error), sender, work=faults)
            return
        self.sched.later(0.0, lambda: done(None), sender, work=faults)  # a live connection took the frame
        if self.partitioned:
            self.counts["partitioned"] += 1
            self._record("partitioned", label, address)
            return
        fate = self.plan.message() if faults else "deliver"
        self.counts[fate] += 1
        if fate != "deliver":
            self._record(fate, label, address)
        if fate == "drop":
            return
        latency = self.rng.uniform(*LATENCY_S)
        if fate == "delay":
            latency += self.rng.random() * self.max_delay_s
        elif fate == "reorder":
            latency += self.rng.random() * 0.01
        for copy in range(2 if fate == "duplicate" else 1):
            self.sched.later(latency + copy * 0.0001,
                             lambda: self._arrive(target.instance, address, frame, label, faults), work=faults)

    def _record(self, fate: str, label: tuple[str, int] | None, address: str) -> None:
        if label is not None and self.record is not None:
            self.record(f"message {fate}", label[1], f"{label[0]} to {address}")

    def _arrive(self, instance: Any, address: str, frame: bytes, label: tuple[str, int] | None = None,
                work: bool = True) -> None:
        target = self.endpoints.get(address)
        if target is None or target.instance is not instance or not instance.alive:
            self.counts["lost"] += 1  # the connection died with the process it led to
            self._record("lost", label, address)
            return
        if instance.frozen():  # waits in the stopped process's socket
            self.sched.later(instance.frozen_until - self.clock.now(),
                             lambda: self._arrive(instance, address, frame, label, work), work=work)
            return
        try:
            msg = open_frame(frame, self.secret)
        except (RejectedFrame, MalformedMessage):
            self.counts["rejected"] += 1
            return
        reason = target.guard.check(msg, self.clock.now())
        if reason is not None:
            self.counts[reason] += 1
            return
        self.counts["delivered"] += 1
        self.last_heard[msg.instance] = self.clock.now()
        target.deliver(msg)


class SimSideChannel:
    """One process instance's ``SideChannelPort`` on the simulated network, and its ``PingPort``: like the real
    ``SideChannel``, it answers a HEARTBEAT ping with a pong, shows every delivered message to its observers (the
    ``PeerMonitor``) and hands only room messages to the node (``on_message``)."""

    def __init__(self, network: SimNetwork, instance: Any, node_id: str, address: str, instance_id: str,
                 healthy: Callable[[], bool] = lambda: True):
        self.network, self.instance, self.node_id = network, instance, node_id
        self.healthy = healthy
        self._address, self.instance_id = address, instance_id
        self.on_message: Callable[[Message], None] = lambda msg: None
        self._observers: list[Callable[[Message], None]] = []

    @property
    def address(self) -> str:
        return self._address

    def stamp(self, cls: type, **fields: Any) -> Any:
        net = self.network
        return cls(sender=self.node_id, instance=self.instance_id, origin=self._address,
                   nonce=net.rng.getrandbits(63), sent_at=net.clock.now(), **fields)

    def post(self, addr: str, msg: Any, done: Callable[[BaseException | None], None]) -> None:
        self.network.transmit(self.instance, addr, seal(msg, self.network.secret), done,
                              label=(msg.TYPE.name, msg.room))

    def forget_peer(self, addr: str) -> None:
        pass  # no cached connections here

    def ping(self, addr: str) -> None:
        self._heartbeat(addr, pong=False)

    def add_observer(self, observer: Callable[[Message], None]) -> None:
        self._observers.append(observer)

    def remove_observer(self, observer: Callable[[Message], None]) -> None:
        self._observers = [o for o in self._observers if o != observer]

    def receive(self, msg: Message) -> None:
        """A message that passed the MAC and replay checks (``SimNetwork._arrive``)."""
        heartbeat = isinstance(msg, Heartbeat)
        if heartbeat and not msg.pong and self.healthy():
            self._heartbeat(msg.origin, pong=True)
        for observer in list(self._observers):
            observer(msg)
        if not heartbeat:
            self.on_message(msg)

    def _heartbeat(self, addr: str, *, pong: bool) -> None:
        msg = self.stamp(Heartbeat, room=0, pong=pong)
        self.network.transmit(self.instance, addr, seal(msg, self.network.secret), lambda error: None, faults=False)
