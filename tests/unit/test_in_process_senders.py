"""``InProcessSenders`` (``--role pd``): a side-channel message to an engine of the same process is handed to its
channel directly, before ``post`` returns, through that channel's replay guard; nothing goes over a socket. A message
to any other address still goes out over ZeroMQ, and a closed channel is no longer reached directly."""

from __future__ import annotations

import threading

from fsm_pd.control.sending import InProcessSenders, PeerSenders
from fsm_pd.transport import SideChannel, generate_secret
from fsm_pd.transport.messages import Abort


def channel(tmp_path, name: str, secret: bytes, inbox: list) -> SideChannel:
    return SideChannel(node_id=name, secret=secret, on_message=inbox.append, bind=f"ipc://{tmp_path}/{name}.sock")


def test_a_message_to_a_peer_of_this_process_is_delivered_directly_and_guarded(tmp_path):
    secret = generate_secret()
    got_p, got_d = [], []
    p, d = channel(tmp_path, "p", secret, got_p), channel(tmp_path, "d", secret, got_d)
    to_p, to_d = InProcessSenders(p), InProcessSenders(d)
    try:
        results: list = []
        msg = d.stamp(Abort, room=7, reason="test")
        to_d.post(p.address, msg, results.append)
        assert got_p == [msg] and results == [None]  # delivered before post returned: no thread, no socket
        assert not p._peers._peers and not d._peers._peers, "no socket was opened to either side"
        to_d.post(p.address, msg, results.append)  # the same nonce again: the receiver's replay guard drops it
        assert got_p == [msg] and p.dropped["replayed"] == 1
        assert d.delivered == 0 and p.delivered == 1
    finally:
        to_p.close()
        to_d.close()
        p.close()
        d.close()


def test_a_message_to_another_process_goes_over_the_socket(tmp_path):
    secret = generate_secret()
    got_far, got_near = [], []
    far = channel(tmp_path, "far", secret, got_far)  # another process's: not registered for direct delivery
    near = channel(tmp_path, "near", secret, got_near)
    senders, far_senders = InProcessSenders(near), PeerSenders(far)
    try:
        sent = threading.Event()
        msg = near.stamp(Abort, room=3, reason="over the wire")
        senders.post(far.address, msg, lambda error: sent.set())
        assert sent.wait(10)
        for _ in range(200):
            if got_far:
                break
            threading.Event().wait(0.02)
        assert [m.room for m in got_far] == [3]
        assert near._peers._peers, "sent over a socket"
    finally:
        senders.close()
        far_senders.close()
        near.close()
        far.close()
