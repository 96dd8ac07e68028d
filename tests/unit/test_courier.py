"""The heartbeat courier with a stand-in send (unit test): frames retried until they go, one frame per peer and kind,
a dead peer never holding up a live one, and expiry reported so the dead peer's socket can be dropped."""

from __future__ import annotations

import threading

from fsm_pd.transport.courier import Courier

LIVE, DEAD = "tcp://127.0.0.1:1", "tcp://127.0.0.1:2"


class Peers:
    def __init__(self, *, refuse_first: int = 0) -> None:
        self.sent: list[tuple[str, bytes]] = []
        self.refusals = {LIVE: refuse_first}
        self.cond = threading.Condition()

    def offer(self, addr: str, frame: bytes) -> bool:
        with self.cond:
            if addr != LIVE:
                return False  # nobody there: never a connection
            if self.refusals[LIVE] > 0:
                self.refusals[LIVE] -= 1  # still connecting
                return False
            self.sent.append((addr, frame))
            self.cond.notify_all()
            return True

    def wait_sent(self, count: int) -> list:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.sent) >= count, 10)
            return list(self.sent)


def test_a_frame_is_retried_until_the_connection_is_up():
    peers = Peers(refuse_first=5)
    courier = Courier(peers.offer, timeout_s=30, name="t")
    courier.post(LIVE, "ping", b"1")
    assert peers.wait_sent(1) == [(LIVE, b"1")]
    assert courier.pending() == 0 and courier.expired == 0
    courier.close()


def test_a_dead_peer_does_not_hold_up_a_live_one_and_its_frame_expires_once():
    peers, events = Peers(), []
    gone = threading.Event()

    def offer(addr, frame):
        ok = peers.offer(addr, frame)
        if ok:
            events.append(("sent", addr))
        return ok

    courier = Courier(offer, timeout_s=2.0, name="t", on_expired=lambda addr: (events.append(("expired", addr)),
                                                                              gone.set()))
    courier.post(DEAD, "ping", b"d")  # first in line, and it will never go
    courier.post(LIVE, "ping", b"l")
    assert gone.wait(30)
    assert events == [("sent", LIVE), ("expired", DEAD)]  # the live peer's frame did not wait for the dead one's
    assert courier.expired == 1 and courier.pending() == 0
    courier.close()


def test_a_newer_frame_replaces_a_waiting_one_of_the_same_kind():
    peers = Peers()
    courier = Courier(peers.offer, timeout_s=30, name="t")
    courier.post(DEAD, "ping", b"old")
    courier.post(DEAD, "ping", b"new")
    courier.post(DEAD, "pong", b"answer")
    assert courier.pending() == 2
    courier.close()
    assert courier.expired == 2  # what was still waiting at close is counted, not sent
    courier.post(LIVE, "ping", b"late")  # after close: ignored
    assert courier.pending() == 0 and peers.sent == []


def test_a_send_that_raises_is_dropped_and_counted():
    def offer(addr, frame):
        raise ValueError("not an address")

    courier = Courier(offer, timeout_s=30, name="t")
    courier.post("http://nope", "ping", b"x")
    courier.close()
    assert courier.expired == 1
