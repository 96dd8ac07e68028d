"""Heartbeats between real SideChannels on 127.0.0.1: pings answered by pongs that name the instance, a listener that
never waits to answer, a node that stops answering when unhealthy, and a PeerMonitor that declares a closed peer
dead after two silent intervals and sees a peer replaced by a new instance at the same address and node id.

Ticks are driven by hand and every wait is for an event with a generous bound: nothing here depends on how fast the
machine is, except the last test, which runs the monitor on the real clock and only bounds the wait for its verdict.
"""

from __future__ import annotations

import threading

import pytest
import zmq
from polling import until

from fsm_pd.control.peer_monitor import PeerMonitor
from fsm_pd.effects.clock import RealClock
from fsm_pd.transport.messages import Heartbeat, Pulled
from fsm_pd.transport.side_channel import SideChannel
from fsm_pd.transport.signing import generate_secret, seal

SECRET = generate_secret()
WAIT_S = 10.0


class Heard:
    """An observer or ``on_message`` that records messages and lets the test wait for one that matches."""

    def __init__(self) -> None:
        self.messages: list = []
        self._cond = threading.Condition()

    def __call__(self, msg) -> None:
        with self._cond:
            self.messages.append(msg)
            self._cond.notify_all()

    def wait_for(self, match, timeout: float = WAIT_S):
        with self._cond:
            assert self._cond.wait_for(lambda: any(match(m) for m in self.messages), timeout), self.messages
            return next(m for m in self.messages if match(m))

    def pongs(self) -> list:
        with self._cond:
            return [m for m in self.messages if isinstance(m, Heartbeat) and m.pong]


@pytest.fixture
def make_channel():
    channels: list[SideChannel] = []

    def make(node_id: str, on_message=None, **kwargs) -> SideChannel:
        channel = SideChannel(node_id=node_id, secret=SECRET, on_message=on_message or (lambda msg: None), **kwargs)
        channels.append(channel)
        return channel

    yield make
    for channel in channels:
        channel.close()


def is_pong_from(channel: SideChannel):
    return lambda m: isinstance(m, Heartbeat) and m.pong and (m.origin, m.instance) == (channel.address,
                                                                                            channel.instance)


def test_a_ping_is_answered_by_a_pong_naming_the_instance_and_neither_reaches_on_message(make_channel):
    a_seen, b_seen, a_inbox, b_inbox = Heard(), Heard(), Heard(), Heard()
    a, b = make_channel("decode-0", a_inbox), make_channel("prefill-0", b_inbox)
    a.add_observer(a_seen)
    b.add_observer(b_seen)
    a.ping(b.address)
    pong = a_seen.wait_for(is_pong_from(b))
    assert pong.sender == "prefill-0" and pong.room == 0
    ping = b_seen.messages[0]
    assert isinstance(ping, Heartbeat) and not ping.pong and (ping.origin, ping.instance) == (a.address, a.instance)
    assert a_inbox.messages == [] and b_inbox.messages == []  # heartbeats are the channel's business
    assert a.delivered == b.delivered == 1 and a.unsent_heartbeats == b.unsent_heartbeats == 0


def test_answering_a_ping_never_blocks_the_listener(make_channel):
    # b's blocking sends would wait 30 s for a peer; its heartbeats may wait 60 s for a connection.
    inbox = Heard()
    b = make_channel("prefill-0", inbox, send_timeout_s=30, heartbeat_timeout_s=60)
    a = make_channel("decode-0")
    ghost = make_channel("ghost")  # a ping from a node that dies before the pong can leave
    ping = ghost.stamp(Heartbeat, room=0, pong=False)
    ghost.close()
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(b.address)
    push.send(seal(ping, SECRET))
    # the ping first: its pong is queued (to a peer that is gone) before the other messages are sent; they came
    # from another socket, so sent together they could be heard before it and prove nothing
    assert until(lambda: b._courier.pending() == 1)
    for room in range(1, 6):
        a.send(b.address, a.stamp(Pulled, room=room, transfer_id=room))
    inbox.wait_for(lambda m: m.room == 5)  # well within the 30 s a blocked listener would have taken
    assert [m.room for m in inbox.messages] == [1, 2, 3, 4, 5]
    assert b._courier.pending() == 1  # the pong to the ghost still waits, off the listener thread
    push.close()
    ctx.term()


def test_an_unhealthy_node_leaves_pings_unanswered(make_channel):
    healthy = threading.Event()
    a_seen, b_inbox, a_inbox = Heard(), Heard(), Heard()
    a = make_channel("decode-0", a_inbox)
    b = make_channel("prefill-0", b_inbox, healthy=healthy.is_set)
    a.add_observer(a_seen)
    b.send(a.address, b.stamp(Pulled, room=1, transfer_id=1))  # b -> a is connected: a pong would go first
    a_inbox.wait_for(lambda m: m.room == 1)
    a.ping(b.address)
    a.send(b.address, a.stamp(Pulled, room=2, transfer_id=2))  # after the ping, on the same connection
    b_inbox.wait_for(lambda m: m.room == 2)  # so b has handled the ping by now
    b.send(a.address, b.stamp(Pulled, room=3, transfer_id=3))
    a_inbox.wait_for(lambda m: m.room == 3)
    assert a_seen.pongs() == []
    healthy.set()
    a.ping(b.address)
    a_seen.wait_for(is_pong_from(b))


def watched_pair(make_channel, *, max_failures: int):
    verdicts = {"dead": [], "changed": []}
    changed = threading.Event()
    a_seen = Heard()
    a = make_channel("decode-0")
    a.add_observer(a_seen)

    def on_changed(addr, old, new):
        verdicts["changed"].append((addr, old, new))
        changed.set()

    monitor = PeerMonitor(a, clock=None, on_dead=verdicts["dead"].append, on_instance_changed=on_changed,
                          interval_s=1.0, max_failures=max_failures)
    return a, a_seen, monitor, verdicts, changed


def test_a_closed_peer_is_declared_dead_after_two_silent_intervals(make_channel):
    a, a_seen, monitor, verdicts, _ = watched_pair(make_channel, max_failures=2)
    b = make_channel("prefill-0")
    assert monitor.watch(b.address) is None
    a_seen.wait_for(is_pong_from(b))  # the ping sent on watch was answered
    assert monitor.instance_of(b.address) == b.instance
    b.close()  # dead, as after SIGKILL: nothing answers at its address any more
    assert monitor.tick() == []  # this interval heard the pong
    assert monitor.tick() == []  # one silent interval
    assert monitor.tick() == [b.address]  # two: dead
    assert verdicts == {"dead": [b.address], "changed": []}
    assert monitor.tick() == [] and monitor.watched() == {}


def test_a_peer_replaced_at_the_same_address_and_node_id_is_seen_as_a_new_instance(make_channel):
    a, a_seen, monitor, verdicts, changed = watched_pair(make_channel, max_failures=1000)
    b = make_channel("prefill-0")
    monitor.watch(b.address, b.instance)
    a_seen.wait_for(is_pong_from(b))
    addr, old = b.address, b.instance
    b.close()
    b2 = make_channel("prefill-0", bind=addr)  # the restart: same node id, same address, new process instance
    assert b2.address == addr and b2.instance != old
    for _ in range(30):  # a's socket reconnects on its own; each tick pings again until the new instance answers
        monitor.tick()
        if changed.wait(1.0):
            break
    assert verdicts == {"dead": [], "changed": [(addr, old, b2.instance)]}
    assert monitor.instance_of(addr) == b2.instance


def test_on_the_real_clock_a_killed_peer_is_declared_dead(make_channel):
    clock = RealClock()
    dead = []
    verdict = threading.Event()
    a = make_channel("decode-0")
    live, doomed = make_channel("prefill-0"), make_channel("prefill-1")
    monitor = PeerMonitor(a, clock=clock, on_dead=lambda addr: (dead.append(addr), verdict.set()),
                          interval_s=0.2, max_failures=2)
    try:
        monitor.watch(live.address)
        monitor.watch(doomed.address)
        monitor.start()
        doomed.close()
        assert verdict.wait(30)
        # only the verdict is checked: whether the live peer kept up on a loaded machine is a matter of timing
        assert doomed.address in dead
    finally:
        monitor.close()
        clock.close()


def test_a_ping_nobody_takes_expires_and_its_socket_is_dropped(make_channel):
    a = make_channel("decode-0", heartbeat_timeout_s=0.1)
    gone = make_channel("prefill-0")
    addr = gone.address
    gone.close()
    a.ping(addr)
    for _ in range(500):  # bounded polling: the courier gives up 0.1 s after the ping, then drops the socket
        if a.unsent_heartbeats and addr not in a._peers:
            break
        threading.Event().wait(0.02)
    assert a.unsent_heartbeats == 1
    assert addr not in a._peers  # not reconnecting to a dead address forever
