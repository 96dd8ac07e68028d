"""The ``zmq`` backend: pure-ZMQ fallback data plane with the same contract as the ``jax`` one.

P streams host bytes of the staging arrays from a ROUTER socket (see ``zmq_server``). D pulls on a fresh DEALER
socket per pull — a timed-out pull leaves chunks in flight, and a fresh socket guarantees none of them is ever read
as part of the next transfer; a loopback connect costs well under a millisecond. D receives each chunk straight
into a preallocated, 64-byte-aligned array (``recv_into``), hands every finished array to ``device_put`` while later
ones are still arriving (on CPU that is zero-copy for aligned buffers), and watches the connection with a socket
monitor so that a dead or vanished P fails the pull at once instead of at the deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import jax
import zmq
from zmq.utils.monitor import recv_monitor_message

from fsm_pd.transport.backends import zmq_wire as wire
from fsm_pd.transport.backends.base import (
    TransferFailed,
    TransferTimeout,
    check_uuid,
    live_staging,
)
from fsm_pd.transport.backends.holds import Hold, HoldingBackend, HoldTable
from fsm_pd.transport.backends.host_buffers import HostBufferPool
from fsm_pd.transport.backends.spec import (
    array_key,
    layout_digest,
    normalize_spec,
    spec_keys,
    summarize,
    verify_pulled,
)
from fsm_pd.transport.backends.zmq_server import ZmqEntry, ZmqPullServer

_PEER_GONE = {
    zmq.EVENT_DISCONNECTED: "producer {address} disconnected during transfer {uuid}",
    zmq.EVENT_CONNECT_RETRIED: "producer {address} refused the connection for transfer {uuid} (not listening)",
}


class ZmqTransferBackend(HoldingBackend):
    name = "zmq"

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        chunk_bytes: int = 512 << 10,
        window: int = 8,
        tombstone_ttl_s: float = 600.0,
        recv_pool_bytes: int = 1 << 30,
        serve: bool = True,
    ) -> None:
        """``window`` chunks of ``chunk_bytes`` may be in flight per pull; ``recv_pool_bytes`` caps the warm receive
        blocks D keeps for reuse (see ``host_buffers``); ``serve=False`` makes a pull-only node."""
        self._window = window
        self._recv_pool = HostBufferPool(recv_pool_bytes)
        self._holds = HoldTable(self._retire, tombstone_ttl_s=tombstone_ttl_s)
        self._server = ZmqPullServer(self._lookup, host=host, port=port, chunk_bytes=chunk_bytes) if serve else None
        self._ctx = zmq.Context()
        self._closed = False
        self._close_lock = threading.Lock()

    @property
    def address(self) -> str:
        if self._server is None:
            raise RuntimeError("this zmq backend was created with serve=False and publishes nothing")
        return self._server.address

    # ---- P side ----

    def publish(self, uuid: int, staging: Sequence[jax.Array], hold_timeout_s: float) -> None:
        check_uuid(uuid)
        server = self._server
        if server is None:
            raise RuntimeError("this zmq backend was created with serve=False")
        arrays = live_staging(staging)
        entry = ZmqEntry.of(arrays)
        self._holds.publish(uuid, sum(a.nbytes for a in arrays), hold_timeout_s, lambda _deadline: entry)
        server.notify("published", uuid)

    def _retire(self, uuid: int, reason: str, hold: Hold | None) -> None:
        # Dropping the hold frees the staging; chunks already queued keep only their own views alive until sent.
        if self._server is not None:
            self._server.notify("ended", uuid, reason)

    def _lookup(self, uuid: int) -> tuple[ZmqEntry | None, str | None]:
        with self._holds.lock:
            hold = self._holds.get(uuid)
            return (hold.payload, None) if hold is not None else (None, self._holds.tombstone(uuid))

    # ---- D side ----

    def pull(
        self, address: str, uuid: int, spec: Sequence[jax.ShapeDtypeStruct], timeout_s: float
    ) -> tuple[jax.Array, ...]:
        deadline = time.monotonic() + timeout_s
        check_uuid(uuid)
        want = normalize_spec(spec)
        want_keys = spec_keys(want, count_shards=False)
        if self._closed:
            raise TransferFailed("this zmq backend is closed", "local")
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
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
            arrays = _Receiver(sock, monitor, self._recv_pool, address, uuid, want, want_keys).run(deadline, timeout_s)
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
    """One pull's receive loop: header, chunks into aligned host arrays, per-array ``device_put``."""

    def __init__(self, sock, monitor, pool: HostBufferPool, address: str, uuid: int, want, want_keys) -> None:
        self.sock, self.monitor, self.pool, self.address, self.uuid = sock, monitor, pool, address, uuid
        self.want, self.want_keys = want, want_keys
        self.host: list = []
        self.placed: list[jax.Array] = []
        self.plan: list[tuple[int, int, int]] = []
        self.next_chunk = 0
        self.unacked = 0

    def run(self, deadline: float, timeout_s: float) -> list[jax.Array]:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                got = f"{self.next_chunk}/{len(self.plan)} chunks" if self.plan else "no header"
                raise TransferTimeout(f"transfer {self.uuid} from {self.address}: {got} after {timeout_s:g} s")
            events = dict(poller.poll(max(1, int(remaining * 1000))))
            if self.sock in events and self._drain():
                return self.placed
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
                self._header(wire.unpack(self.sock.recv()))
            elif kind == wire.DONE:
                if self.next_chunk != len(self.plan) or len(self.placed) != len(self.want):
                    raise TransferFailed(f"transfer {self.uuid}: producer ended the stream early")
                return True
            elif kind == wire.FAIL:
                body = wire.unpack(self.sock.recv())
                reason = body.get("reason", "unknown failure")
                if body.get("published"):
                    reason = f"{reason} for transfer {self.uuid}: published {body['published']}, expected "
                    reason += summarize(self.want_keys)
                raise TransferFailed(reason, "local" if body.get("blame") == "local" else "remote")
            else:
                raise TransferFailed(f"transfer {self.uuid}: unexpected message {kind[:16]!r} from producer")

    def _header(self, header: dict) -> None:
        arrays = [(tuple(shape), dtype) for shape, dtype in header["arrays"]]
        got_keys = [array_key(shape, dtype, None) for shape, dtype in arrays]
        if layout_digest(got_keys) != layout_digest(self.want_keys):  # P checked the digest too; trust neither
            raise TransferFailed(
                f"spec mismatch for transfer {self.uuid}: published {summarize(got_keys)}, "
                f"expected {summarize(self.want_keys)}",
                "local",
            )
        self.host = self.pool.arrays(arrays)
        self.flat = [h.reshape(-1).view("uint8") for h in self.host]
        self.plan = wire.chunk_plan([h.nbytes for h in self.host], int(header["chunk_bytes"]))
        self._place_finished()  # empty arrays have no chunks

    def _chunk(self) -> None:
        if not self.plan or self.next_chunk >= len(self.plan):
            raise TransferFailed(f"transfer {self.uuid}: data chunk outside the announced plan")
        index, offset, length = self.plan[self.next_chunk]
        received = self.sock.recv_into(self.flat[index][offset : offset + length])
        if received != length:
            raise TransferFailed(f"transfer {self.uuid}: chunk {self.next_chunk} has {received} bytes, not {length}")
        self.next_chunk += 1
        self.unacked += 1
        self._ack()  # at once: the credit reaches P while this thread is still placing and receiving
        self._place_finished()

    def _ack(self) -> None:
        self.sock.send_multipart([wire.CREDIT, wire.pack_u32(self.unacked)])
        self.unacked = 0

    def _place_finished(self) -> None:
        """``device_put`` every array whose last chunk has landed, so host-to-device overlaps the rest."""
        done_upto = self.plan[self.next_chunk][0] if self.next_chunk < len(self.plan) else len(self.host)
        while len(self.placed) < done_upto:
            i = len(self.placed)
            try:
                self.placed.append(jax.device_put(self.host[i], self.want[i].sharding))
            except Exception as exc:  # noqa: BLE001 - e.g. out of device memory on this node
                raise TransferFailed(f"transfer {self.uuid}: could not place array {i}: {exc}", "local") from exc
