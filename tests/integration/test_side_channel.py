"""SideChannel over real ZMQ sockets on 127.0.0.1: delivery, rejection of bad frames, bounded sends, clean close."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import select
import subprocess
import sys
import threading
import time

import msgpack
import pytest
import zmq
from processes import dies_with_parent

from fsm_pd.cli.launch import free_port
from fsm_pd.kernels.layout import KVLayout
from fsm_pd.transport.messages import Abort, MessageType, Prepare, Pulled, Ready, encode_body
from fsm_pd.transport.side_channel import (
    BadPeerAddress,
    ChannelClosed,
    MessageTooLarge,
    PeerUnreachable,
    SideChannel,
)
from fsm_pd.transport.signing import WIRE_VERSION, generate_secret, seal, secret_env

SECRET = generate_secret()
LAYOUT = KVLayout(num_layers=2, num_pages=16, page_size=4, kv_heads=1, head_dim=8).to_dict()


class Inbox:
    """An ``on_message`` callback that records what arrives and lets the test wait for it."""

    def __init__(self) -> None:
        self.messages: list = []
        self._cond = threading.Condition()

    def __call__(self, msg) -> None:
        with self._cond:
            self.messages.append(msg)
            self._cond.notify_all()

    def wait_for(self, count: int, timeout: float = 5.0) -> list:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.messages) >= count, timeout), self.messages
            return list(self.messages)


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


@pytest.fixture
def raw_push():
    """A bare PUSH socket, for frames no SideChannel would send."""
    ctx = zmq.Context()
    sockets: list[zmq.Socket] = []

    def connect(addr: str) -> zmq.Socket:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, 2000)
        sock.connect(addr)
        sockets.append(sock)
        return sock

    yield connect
    for sock in sockets:
        sock.close()
    ctx.term()


def one_of_each(channel: SideChannel, room: int, reply_to: str) -> list:
    stamp = channel.stamp
    return [
        stamp(Prepare, room=room, transfer_id=1, reply_to=reply_to, layout=LAYOUT, page_count=2, prompt_len=7),
        stamp(
            Ready,
            room=room,
            transfer_id=1,
            uuid=99,
            transfer_addr="127.0.0.1:9",
            backend="fake",
            layout=LAYOUT,
            page_count=2,
            first_token=5,
            first_logprob=-0.25,
            input_logprobs=[-1.0, -2.0],
        ),
        stamp(Pulled, room=room, transfer_id=1),
        stamp(Abort, room=room, reason="test"),
    ]


def test_two_channels_exchange_every_message_type(make_channel):
    a_in, b_in = Inbox(), Inbox()
    a, b = make_channel("decode-0", a_in), make_channel("prefill-0", b_in)
    assert a.address.startswith("tcp://127.0.0.1:") and a.address != b.address
    sent_to_b = one_of_each(a, room=11, reply_to=a.address)
    sent_to_a = one_of_each(b, room=12, reply_to=b.address)
    for msg in sent_to_b:
        a.send(b.address, msg)
    for msg in sent_to_a:
        b.send(a.address, msg)
    assert b_in.wait_for(4) == sent_to_b  # one connection: order is kept
    assert a_in.wait_for(4) == sent_to_a
    assert {m.TYPE for m in sent_to_b} == set(MessageType) - {MessageType.HEARTBEAT}  # heartbeats: test_heartbeats
    for msg in b_in.messages:  # who sent it, from where, which run of that process
        assert (msg.sender, msg.origin, msg.instance) == ("decode-0", a.address, a.instance)
    assert a.instance != b.instance
    assert a.delivered == b.delivered == 4
    assert not any(a.dropped.values()) and not any(b.dropped.values())


ECHO_PEER = """
import dataclasses, sys, time
from fsm_pd.transport.messages import new_nonce
from fsm_pd.transport.side_channel import SideChannel
from fsm_pd.transport.signing import secret_from_env

def echo(msg):
    # Every message says where it came from: send it back there as our own.
    copy = dataclasses.replace(msg, sender=channel.node_id, instance=channel.instance, origin=channel.address,
                               nonce=new_nonce(), sent_at=time.time())
    channel.send(msg.origin, copy)

channel = SideChannel(node_id="child", secret=secret_from_env(), on_message=echo)
print(channel.address, flush=True)
sys.stdin.read()  # run until the parent closes our stdin
channel.close()
print("closed", flush=True)
"""


def test_a_peer_in_another_process_gets_the_secret_from_env_and_answers(make_channel):
    env = {**os.environ, **secret_env(SECRET)}
    child = subprocess.Popen(
        [sys.executable, "-c", ECHO_PEER], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        preexec_fn=dies_with_parent(),
    )
    try:
        ready, _, _ = select.select([child.stdout], [], [], 30)
        assert ready, "child did not start"
        child_addr = child.stdout.readline().strip()
        assert child_addr.startswith("tcp://127.0.0.1:")
        inbox = Inbox()
        parent = make_channel("parent", inbox)
        sent = one_of_each(parent, room=21, reply_to=parent.address)
        for msg in sent:
            parent.send(child_addr, msg)
        echoed = inbox.wait_for(4, timeout=10)
        assert [m.TYPE for m in echoed] == [m.TYPE for m in sent]
        for got, orig in zip(echoed, sent, strict=True):
            assert got.sender == "child" and got.nonce != orig.nonce and got.origin == child_addr
            assert got.instance != parent.instance
            assert dataclasses.replace(got, sender=orig.sender, instance=orig.instance, origin=orig.origin,
                                       nonce=orig.nonce, sent_at=orig.sent_at) == orig
        child.stdin.close()
        assert child.stdout.readline().strip() == "closed"
        assert child.wait(timeout=10) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_bad_frames_are_dropped_and_counted_while_valid_traffic_continues(make_channel, raw_push):
    limit = 4096
    inbox = Inbox()
    a = make_channel("decode-0", inbox, max_frame_bytes=limit, max_skew_s=30)
    b = make_channel("prefill-0")
    raw = raw_push(a.address)

    valid = b.stamp(Pulled, room=1, transfer_id=1)
    stale = dataclasses.replace(b.stamp(Pulled, room=2, transfer_id=1), sent_at=time.time() - 1000)
    future = dataclasses.replace(b.stamp(Pulled, room=3, transfer_id=1), sent_at=time.time() + 1000)
    header = bytes((WIRE_VERSION, MessageType.PULLED))
    signed_garbage = _sign(header + msgpack.packb(["not", "a", "pulled"]))
    big = b.stamp(Abort, room=4, reason="x" * limit)

    raw.send(seal(valid, SECRET))  # delivered
    raw.send(seal(b.stamp(Pulled, room=5, transfer_id=1), generate_secret()))  # bad_mac: forged
    raw.send(header + encode_body(valid))  # unsigned
    raw.send(b"hello")  # unsigned: too short to carry a MAC
    raw.send(seal(big, SECRET))  # oversized (though correctly signed)
    raw.send(seal(valid, SECRET))  # replayed
    raw.send(seal(stale, SECRET))  # stale
    raw.send(seal(future, SECRET))  # stale
    raw.send(signed_garbage)  # malformed
    raw.send(b"\x01" + seal(valid, SECRET)[1:])  # bad_version: wire version 1, before instances
    raw.send_multipart([seal(b.stamp(Pulled, room=6, transfer_id=1), SECRET), b"x"])  # malformed: two parts
    last = b.stamp(Pulled, room=7, transfer_id=1)
    raw.send(seal(last, SECRET))  # delivered: the listener survived all of the above

    assert inbox.wait_for(2) == [valid, last]
    assert a.dropped == {
        "oversized": 1,
        "bad_version": 1,
        "unsigned": 2,
        "bad_mac": 1,
        "malformed": 2,
        "stale": 2,
        "replayed": 1,
        "duplicate": 0,
    }
    # and a real channel can still talk to it
    ok = b.stamp(Pulled, room=8, transfer_id=1)
    b.send(a.address, ok)
    assert inbox.wait_for(3)[-1] == ok


def test_a_frame_beyond_the_hard_cap_costs_the_sender_its_connection_not_the_listener(make_channel, raw_push):
    inbox = Inbox()
    a = make_channel("decode-0", inbox, max_frame_bytes=1024)
    raw_push(a.address).send(b"\x01" * 64 * 1024)  # above libzmq's MAXMSGSIZE backstop
    b = make_channel("prefill-0")
    ok = b.stamp(Pulled, room=1, transfer_id=1)
    b.send(a.address, ok)
    assert inbox.wait_for(1) == [ok]


def test_duplicate_pulled_is_delivered_once(make_channel):
    inbox = Inbox()
    a, b = make_channel("prefill-0", inbox), make_channel("decode-0")
    first = b.stamp(Pulled, room=7, transfer_id=1)
    for msg in (first, b.stamp(Pulled, room=7, transfer_id=1), b.stamp(Pulled, room=7, transfer_id=2)):
        b.send(a.address, msg)  # retransmissions carry fresh nonces
    other_room = b.stamp(Pulled, room=8, transfer_id=1)
    b.send(a.address, other_room)
    assert inbox.wait_for(2) == [first, other_room]
    assert a.dropped["duplicate"] == 2 and a.delivered == 2


def test_send_to_a_dead_peer_raises_within_the_bound(make_channel):
    bound = 0.3
    a = make_channel("decode-0", send_timeout_s=bound)
    msg = a.stamp(Pulled, room=1, transfer_id=1)

    started = time.monotonic()
    with pytest.raises(PeerUnreachable):
        a.send(f"tcp://127.0.0.1:{_closed_port()}", msg)  # nobody ever listened there
    assert time.monotonic() - started < bound + 0.5

    b = make_channel("prefill-0")
    addr = b.address
    a.send(addr, msg)
    b.close()
    # Until libzmq notices the disconnect, a send still "succeeds" and its frame is lost: a return from send() is not
    # a delivery receipt. Once it notices, every send fails within the bound.
    deadline = time.monotonic() + 5
    while True:
        started = time.monotonic()
        try:
            a.send(addr, a.stamp(Pulled, room=2, transfer_id=1))
        except PeerUnreachable:
            break
        assert time.monotonic() < deadline, "the dead peer was never noticed"
        time.sleep(0.05)
    assert time.monotonic() - started < bound + 0.5

    # A peer restarted at the same address is reached afresh (the failed socket was dropped).
    inbox = Inbox()
    restarted = make_channel("prefill-0", inbox, bind=addr)
    assert restarted.address == addr
    again = a.stamp(Pulled, room=3, transfer_id=1)
    a.send(addr, again)
    assert inbox.wait_for(1) == [again]


def test_forget_peer_drops_the_cached_socket(make_channel):
    inbox = Inbox()
    a, b = make_channel("a"), make_channel("b", inbox)
    a.send(b.address, a.stamp(Abort, room=1, reason="r"))
    assert b.address in a._peers
    a.forget_peer(b.address)
    a.forget_peer(b.address)  # idempotent
    assert b.address not in a._peers
    a.send(b.address, a.stamp(Abort, room=2, reason="r"))
    assert [m.room for m in inbox.wait_for(2)] == [1, 2]


def test_bad_addresses_and_oversized_sends_are_refused_up_front(make_channel):
    a = make_channel("a", max_frame_bytes=512)
    msg = a.stamp(Pulled, room=1, transfer_id=1)
    for addr in ("http://127.0.0.1:1", "127.0.0.1:5555", "tcp://", 42):
        with pytest.raises(BadPeerAddress):
            a.send(addr, msg)
    with pytest.raises(MessageTooLarge):
        a.send("tcp://127.0.0.1:1", a.stamp(Abort, room=1, reason="x" * 600))


def test_an_exception_in_on_message_is_counted_and_the_listener_carries_on(make_channel):
    inbox = Inbox()

    def flaky(msg):
        if msg.room == 1:
            raise RuntimeError("handler bug")
        inbox(msg)

    a, b = make_channel("a", on_message=flaky), make_channel("b")
    b.send(a.address, b.stamp(Abort, room=1, reason="r"))
    b.send(a.address, b.stamp(Abort, room=2, reason="r"))
    assert [m.room for m in inbox.wait_for(1)] == [2]
    assert a.handler_errors == 1 and a.delivered == 2


def test_close_stops_the_thread_and_is_final(make_channel):
    before = set(threading.enumerate())
    inbox = Inbox()
    a, b = make_channel("a", inbox), make_channel("b")
    b.send(a.address, b.stamp(Abort, room=1, reason="r"))
    inbox.wait_for(1)
    a.close()
    b.close()
    b.close()  # idempotent
    assert set(threading.enumerate()) == before
    with pytest.raises(ChannelClosed):
        b.send(a.address, b.stamp(Abort, room=2, reason="r"))


def test_close_from_inside_on_message_does_not_deadlock():
    closed = threading.Event()

    def close_self(msg):
        channel.close()
        closed.set()

    channel = SideChannel(node_id="a", secret=SECRET, on_message=close_self)
    with SideChannel(node_id="b", secret=SECRET, on_message=Inbox()) as other:
        other.send(channel.address, other.stamp(Abort, room=1, reason="r"))
        assert closed.wait(5)
    channel._thread.join(5)
    assert not channel._thread.is_alive()


def _sign(signed_part: bytes) -> bytes:
    return signed_part + hmac.new(SECRET, signed_part, hashlib.sha256).digest()


def _closed_port() -> int:
    return free_port()
