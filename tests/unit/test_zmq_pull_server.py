"""The zmq backend's pull server answers a malformed PULL at once and lives on: a PULL is checked whole when it
arrives, so one parked until its entry is published cannot fail later on the server's thread (that used to kill the
thread, and every later pull of the node waited for nothing)."""

from __future__ import annotations

import contextlib

import jax.numpy as jnp
import pytest
import zmq
from node_sockets import node_sockets

from fsm_pd.transport.backends import zmq_wire as wire
from fsm_pd.transport.backends.host_stream import HostEntry
from fsm_pd.transport.backends.zmq_server import ZmqPullServer

UUID = 7
REPLY_TIMEOUT_MS = 10_000  # a hang, not a slow answer: every reply here is immediate


@pytest.fixture
def server(tmp_path):
    published: dict[int, HostEntry] = {}
    srv = ZmqPullServer(lambda uuid: (published.get(uuid), None), **node_sockets(tmp_path, "pull"))
    try:
        yield srv, published
    finally:
        srv.stop()


@contextlib.contextmanager
def puller(address: str):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        yield sock
    finally:
        sock.close()
        ctx.term()


def reply(sock) -> list[bytes]:
    assert sock.poll(REPLY_TIMEOUT_MS), "no reply from the pull server"
    return sock.recv_multipart()


def pull_body(entry: HostEntry | None = None, **changes) -> bytes:
    fields = {"v": wire.PROTOCOL_VERSION, "uuid": UUID, "digest": entry.digest if entry else b"x", "window": 4,
              "timeout_s": 30.0, **changes}
    return wire.pack({k: v for k, v in fields.items() if v is not None})


@pytest.mark.parametrize("changes, complaint", [
    ({"digest": None}, "PULL without 'digest'"),
    ({"window": 0}, "window is not a positive integer"),
    ({"window": "4"}, "window is not a positive integer"),
    ({"uuid": "7"}, "uuid is not an integer"),
    ({"timeout_s": float("nan")}, "timeout_s is not a positive number"),
])
def test_a_malformed_pull_of_an_unpublished_entry_fails_at_once_and_the_server_serves_on(server, changes, complaint):
    srv, published = server
    with puller(srv.address) as bad:
        bad.send_multipart([wire.PULL, pull_body(**changes)])
        kind, body = reply(bad)
        assert kind == wire.FAIL
        failure = wire.unpack(body)
        assert failure["blame"] == "local" and complaint in failure["reason"], failure
    assert UUID not in srv.parked  # answered, never parked

    entry = HostEntry.of((jnp.arange(16, dtype=jnp.float32),))
    published[UUID] = entry
    srv.notify("published", UUID)  # what used to start the parked malformed pull, on the server's thread
    with puller(srv.address) as good:
        good.send_multipart([wire.PULL, pull_body(entry)])
        kind, body = reply(good)
        assert kind == wire.HEAD, (kind, body)
        good.send_multipart([wire.CREDIT, wire.pack_u32(4)])
        kind, data = reply(good)
        assert kind == wire.DATA and bytes(data) == bytes(entry.host_bytes(0))
        assert reply(good) == [wire.DONE]
