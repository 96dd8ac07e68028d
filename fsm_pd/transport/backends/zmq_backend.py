"""The ``zmq`` backend: pure-ZMQ fallback data plane with the same contract as the ``jax`` one.

P streams host bytes of the staging arrays from a ROUTER socket (see ``zmq_server``). D pulls on a fresh DEALER
socket per pull — a timed-out pull leaves chunks in flight, and a fresh socket guarantees none of them is ever read
as part of the next transfer; a loopback connect costs well under a millisecond. D receives each chunk straight
into a preallocated, 64-byte-aligned array (``recv_into``), hands every finished array to ``device_put`` while later
ones are still arriving (on CPU that is zero-copy for aligned buffers), and watches the connection with a socket
monitor so that a dead or vanished P fails the pull at once instead of at the deadline.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from fsm_pd.transport.backends import zmq_wire as wire
from fsm_pd.transport.backends.base import (
    OnProgress,
    StagingProgress,
    TransferFailed,
    TransferTimeout,
    check_uuid,
    live_staging,
)
from fsm_pd.transport.backends.holds import Hold
from fsm_pd.transport.backends.host_stream import HostEntry, HostStreamBackend, Landing
from fsm_pd.transport.backends.spec import layout_digest, summarize, verify_pulled
from fsm_pd.transport.backends.zmq_server import ZmqPullServer

_PEER_GONE = {
    zmq.EVENT_DISCONNECTED: "producer {address} disconnected during transfer {uuid}",
    zmq.EVENT_CONNECT_RETRIED: "producer {address} refused the connection for transfer {uuid} (not listening)",
}


class ZmqTransferBackend(HostStreamBackend):
    name = "zmq"
    progressive = True

    def __init__(self, *, chunk_bytes: int = 512 << 10, window: int = 8, **options: Any) -> None:
        """``window`` chunks of ``chunk_bytes`` may be in flight per pull; ``options``: ``HostStreamBackend``'s
        (host, advertise_host, port, tombstone_ttl_s, recv_pool_bytes, serve)."""
        self._chunk_bytes, self._window = chunk_bytes, window
        super().__init__(**options)
        self._ctx = zmq.Context()

    def _make_server(self, host: str, port: int, uds: str | None) -> ZmqPullServer:
        return ZmqPullServer(self._holds.lookup, host=host, port=port, uds=uds, chunk_bytes=self._chunk_bytes)

    def parked_pulls(self) -> frozenset[int]:
        return frozenset() if self._server is None else self._server.parked

    # ---- P side ----

    def publish(self, uuid: int, staging: Sequence[jax.Array], hold_timeout_s: float) -> None:
        check_uuid(uuid)
        server = self._require_server()
        arrays = live_staging(staging)
        entry = HostEntry.of(arrays)
        self._holds.publish(uuid, sum(a.nbytes for a in arrays), hold_timeout_s, lambda _deadline: entry)
        server.notify("published", uuid)

    def publish_progressive(self, uuid: int, host: np.ndarray, hold_timeout_s: float) -> StagingProgress:
        check_uuid(uuid)
        server = self._require_server()
        progress = StagingProgress(host, lambda: server.notify("filled", uuid))
        entry = HostEntry.filling(progress)
        self._holds.publish(uuid, progress.nbytes, hold_timeout_s, lambda _deadline: entry)
        server.notify("published", uuid)
        return progress

    def _retire(self, uuid: int, reason: str, hold: Hold | None) -> None:
        # Dropping the hold frees the staging; chunks already queued keep only their own views alive until sent.
        if self._server is not None:
            self._server.notify("ended", uuid, reason)

    # ---- D side ----

    def _pull(self, address: str, uuid: int, want: list, want_keys: list, deadline: float, timeout_s: float,
              on_progress: OnProgress | None) -> tuple[jax.Array, ...]:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        if "[" in address:  # an IPv6 literal: zmq connects only IPv4 unless told
            sock.setsockopt(zmq.IPV6, 1)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED)
        try:
            try:
                sock.connect(address)
            except zmq.ZMQError as exc:
                raise TransferFailed(f"cannot connect to {address!r}: {exc}", "local") from exc
            request = {
                "v": wire.PROTOCOL_VERSION,
                "uuid": uuid,
                "digest": layout_digest(want_keys),
                "window": self._window,
                "timeout_s": timeout_s,
            }
            sock.send_multipart([wire.PULL, wire.pack(request)])
            landing = Landing(self._recv_pool, uuid, want, want_keys, on_progress)
            arrays = _Receiver(sock, monitor, landing, address, uuid).run(deadline, timeout_s)
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
        return verify_pulled(arrays, want, lambda exc: TransferFailed(f"transfer {uuid}: {exc}", "local"))

    def close(self) -> None:
        """End every hold and stop serving; waits for this backend's in-flight pulls (each ends by its deadline)."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._holds.close("producer closed")
        if self._server is not None:
            self._server.stop()
        self._ctx.term()


class _Receiver:
    """One pull's receive loop: header, credit-paced chunks straight into their ``Landing`` place."""

    def __init__(self, sock, monitor, landing: Landing, address: str, uuid: int) -> None:
        self.sock, self.monitor, self.landing, self.address, self.uuid = sock, monitor, landing, address, uuid
        self.unacked = 0

    def run(self, deadline: float, timeout_s: float) -> list[jax.Array]:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                got = self.landing.progress_text()
                raise TransferTimeout(f"transfer {self.uuid} from {self.address}: {got} after {timeout_s:g} s")
            events = dict(poller.poll(max(1, int(remaining * 1000))))
            if self.sock in events and self._drain():
                return self.landing.placed
            if self.monitor in events:
                event = recv_monitor_message(self.monitor)["event"]
                if event in _PEER_GONE:
                    raise TransferFailed(_PEER_GONE[event].format(address=self.address, uuid=self.uuid))

    def _drain(self) -> bool:
        """Handle every queued message; True once the transfer is complete."""
        while True:
            try:
                kind = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                if self.unacked:
                    self._ack()
                return False
            if kind == wire.DATA:
                self._chunk()
            elif kind == wire.HEAD:
                header = wire.unpack(self.sock.recv())
                self.landing.header(header["arrays"])
                self.chunk_bytes = int(header["chunk_bytes"])
            elif kind == wire.DONE:
                if not self.landing.complete:
                    raise TransferFailed(f"transfer {self.uuid}: producer ended the stream early")
                return True
            elif kind == wire.FAIL:
                body = wire.unpack(self.sock.recv())
                reason = body.get("reason", "unknown failure")
                if body.get("published"):
                    reason = f"{reason} for transfer {self.uuid}: published {body['published']}, expected "
                    reason += summarize(self.landing.want_keys)
                raise TransferFailed(reason, "local" if body.get("blame") == "local" else "remote")
            else:
                raise TransferFailed(f"transfer {self.uuid}: unexpected message {kind[:16]!r} from producer")

    def _chunk(self) -> None:
        # Chunks carry no index: P cuts each array into chunk_bytes pieces, so the next one is at most that long.
        landing = self.landing
        expected = min(self.chunk_bytes, len(landing.flat[landing.index]) - landing.offset) if landing.started else 0
        target = landing.target(expected)
        received = self.sock.recv_into(target)
        if received != expected:
            raise TransferFailed(f"transfer {self.uuid}: a chunk has {received} bytes, not {expected}")
        self.unacked += 1
        self._ack()  # at once: the credit reaches P while this thread is still placing and receiving
        landing.landed(received)

    def _ack(self) -> None:
        self.sock.send_multipart([wire.CREDIT, wire.pack_u32(self.unacked)])
        self.unacked = 0
