"""PeerMonitor on a virtual clock: who is declared dead and when, restarts seen at once, late messages of a replaced
instance, and the heartbeat settings. The network is a stand-in that answers pings at once (unit test only; the real
side channel is in tests/integration/test_heartbeats.py)."""

from __future__ import annotations

import pytest

from fsm_pd.control.config import heartbeat_settings
from fsm_pd.control.peer_monitor import PeerMonitor
from fsm_pd.effects.clock import VirtualClock
from fsm_pd.transport.messages import Heartbeat, Pulled, new_nonce

P = "tcp://127.0.0.1:7001"
Q = "tcp://127.0.0.1:7002"


def heard_from(addr: str, instance: str, *, pong: bool = True):
    return Heartbeat(room=0, sender="prefill-0", instance=instance, origin=addr, nonce=new_nonce(), sent_at=0.0,
                     pong=pong)


class Network:
    """Peers that answer a ping at once with a pong from their current instance, while they are up."""

    def __init__(self) -> None:
        self.observers: list = []
        self.up: dict[str, str] = {}  # addr -> instance answering there
        self.pings: list[str] = []

    def ping(self, addr: str) -> None:
        self.pings.append(addr)
        if addr in self.up:
            self.deliver(heard_from(addr, self.up[addr]))

    def deliver(self, msg) -> None:
        for observer in list(self.observers):
            observer(msg)

    def add_observer(self, observer) -> None:
        self.observers.append(observer)

    def remove_observer(self, observer) -> None:
        self.observers = [o for o in self.observers if o != observer]


class Recorder:
    def __init__(self, clock: VirtualClock | None = None) -> None:
        self.clock = clock
        self.dead: list[tuple[str, float | None]] = []
        self.changed: list[tuple[str, str, str]] = []

    def on_dead(self, addr: str) -> None:
        self.dead.append((addr, self.clock.now() if self.clock else None))

    def on_instance_changed(self, addr: str, old: str, new: str) -> None:
        self.changed.append((addr, old, new))


@pytest.fixture
def world():
    clock, net = VirtualClock(), Network()
    seen = Recorder(clock)
    monitor = PeerMonitor(net, clock=clock, on_dead=seen.on_dead, on_instance_changed=seen.on_instance_changed,
                          interval_s=1.0, max_failures=2).start()
    yield clock, net, seen, monitor
    monitor.close()


def run_until(clock: VirtualClock, t: float) -> None:
    while clock.next_time() is not None and clock.next_time() <= t:
        clock.fire_next()


def test_a_peer_that_answers_is_pinged_every_interval_and_never_declared_dead(world):
    clock, net, seen, monitor = world
    net.up[P] = "p1"
    assert monitor.watch(P, "p1") == "p1"
    run_until(clock, 100.0)
    assert seen.dead == [] and seen.changed == []
    assert net.pings == [P] * 101  # once when watched, then at every tick
    assert monitor.watched() == {P: "p1"}


def test_a_peer_that_goes_silent_is_declared_dead_once_two_to_three_intervals_later(world):
    clock, net, seen, monitor = world
    net.up[P] = "p1"
    monitor.watch(P)
    run_until(clock, 5.0)  # its last pong answers the ping of the tick at t=5
    del net.up[P]
    run_until(clock, 7.0)
    assert seen.dead == []  # the tick at 6 heard that pong; the one at 7 counts the first miss
    run_until(clock, 8.0)
    assert seen.dead == [(P, 8.0)]  # the second silent interval: 3 intervals after its last pong
    pings = len(net.pings)
    run_until(clock, 50.0)
    assert seen.dead == [(P, 8.0)] and len(net.pings) == pings  # declared once, then no longer watched
    assert monitor.watched() == {}


def test_a_peer_dead_from_the_start_is_declared_dead_after_max_failures_ticks(world):
    clock, net, seen, monitor = world
    monitor.watch(Q)
    run_until(clock, 2.0)
    assert seen.dead == [(Q, 2.0)]


def test_any_message_from_the_peer_counts_not_only_pongs(world):
    clock, net, seen, monitor = world
    monitor.watch(P, "p1")  # P never answers pings, but talks
    for t in range(1, 30):
        net.deliver(Pulled(room=t, sender="prefill-0", instance="p1", origin=P, nonce=new_nonce(), sent_at=0.0,
                           transfer_id=t))
        run_until(clock, float(t))
    assert seen.dead == []


def test_a_new_instance_is_reported_at_once_and_late_messages_of_the_old_one_are_ignored(world):
    clock, net, seen, monitor = world
    net.up[P] = "p1"
    monitor.watch(P, "p1")
    run_until(clock, 3.0)
    net.up[P] = "p2"  # restarted at the same address
    net.deliver(heard_from(P, "p2", pong=False))  # its first message, between two ticks
    assert seen.changed == [(P, "p1", "p2")] and clock.now() == 3.0
    assert monitor.instance_of(P) == "p2"
    assert monitor.watch(P, "p1") == "p2"  # a caller still expecting p1 learns that p1 is gone
    net.deliver(heard_from(P, "p1"))  # late or reordered: neither a change back nor a sign of life
    assert seen.changed == [(P, "p1", "p2")] and monitor.instance_of(P) == "p2"
    del net.up[P]
    for t in range(4, 10):  # only the old instance keeps "talking": P is still declared dead
        net.deliver(heard_from(P, "p1"))
        run_until(clock, float(t))
    assert [addr for addr, _ in seen.dead] == [P]


def test_the_first_instance_heard_is_learned_without_a_change(world):
    clock, net, seen, monitor = world
    net.up[P] = "p1"
    assert monitor.watch(P) is None
    assert monitor.instance_of(P) == "p1"  # the pong to the ping sent on watch
    net.deliver(heard_from(Q, "q1"))  # not watched: ignored
    assert seen.changed == [] and monitor.watched() == {P: "p1"}


def test_unwatch_stops_pings_and_verdicts(world):
    clock, net, seen, monitor = world
    monitor.watch(Q)
    monitor.unwatch(Q)
    run_until(clock, 10.0)
    assert seen.dead == [] and net.pings == [Q]


def test_close_stops_ticking_and_observing(world):
    clock, net, seen, monitor = world
    monitor.watch(Q)
    monitor.close()
    monitor.close()  # idempotent
    assert clock.next_time() is None and net.observers == []
    run_until(clock, 10.0)
    assert seen.dead == []


def test_a_callback_that_raises_does_not_stop_the_monitor():
    clock, net = VirtualClock(), Network()
    calls = []

    def broken(addr, *rest):
        calls.append(addr)
        raise RuntimeError("handler bug")

    monitor = PeerMonitor(net, clock=clock, on_dead=broken, on_instance_changed=broken, max_failures=1).start()
    net.up[P] = "p1"
    monitor.watch(P, "p0")  # the pong shows p1: a change, reported to a callback that raises
    monitor.watch(Q)
    run_until(clock, 1.0)
    assert calls == [P, Q]
    run_until(clock, 5.0)
    assert monitor.watched() == {P: "p1"}  # still watching, still ticking


def test_manual_ticks_without_a_clock():
    net, seen = Network(), Recorder()
    monitor = PeerMonitor(net, clock=None, on_dead=seen.on_dead, max_failures=3)
    with pytest.raises(RuntimeError, match="tick"):
        monitor.start()
    monitor.watch(Q)
    assert [monitor.tick() for _ in range(3)] == [[], [], [Q]]


@pytest.mark.parametrize("kwargs", [{"interval_s": 0}, {"interval_s": float("nan")}, {"max_failures": 0}])
def test_settings_are_checked(kwargs):
    with pytest.raises(ValueError):
        PeerMonitor(Network(), clock=None, on_dead=print, **kwargs)


def test_heartbeat_settings_defaults_and_environment():
    assert heartbeat_settings({}) == {"interval_s": 1.0, "max_failures": 2}
    assert heartbeat_settings({"FSM_PD_HEARTBEAT_INTERVAL": "0.5", "FSM_PD_HEARTBEAT_MAX_FAILURES": "3"}) == {
        "interval_s": 0.5, "max_failures": 3}
    assert heartbeat_settings({"FSM_PD_HEARTBEAT_MAX_FAILURE": "4"})["max_failures"] == 4  # the older spelling
    for bad in ({"FSM_PD_HEARTBEAT_INTERVAL": "soon"}, {"FSM_PD_HEARTBEAT_INTERVAL": "0"},
                {"FSM_PD_HEARTBEAT_MAX_FAILURES": "0"}):
        with pytest.raises(ValueError, match="FSM_PD_HEARTBEAT"):
            heartbeat_settings(bad)
    settings = heartbeat_settings({})
    PeerMonitor(Network(), clock=None, on_dead=print, **settings)  # the keys are the monitor's
