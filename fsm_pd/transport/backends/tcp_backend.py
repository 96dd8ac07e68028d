"""The ``tcp`` backend: staging bytes over one plain TCP connection per pull, received straight into place. With
``uds`` the same stream runs over a unix socket instead (address ``unix:PATH``), for hosts that allow no TCP.

Same contract and the same P-side entries (``host_stream``) as the ``zmq`` backend, with a thinner wire: TCP's flow
control replaces credits, and D ``recv_into``s every data frame directly into its aligned host array, the one copy
a bare socket makes, where libzmq first lands each message in a buffer of its own and then copies it out (on the
2-core dev VM that second copy cost about as much CPU as the kernel's). Use it where the copies compete with the
wire for a few cores; ``zmq`` remains the fallback with ZeroMQ's own socket handling.

Failures end a pull at once rather than at its deadline where TCP can tell: a refused connect (nobody listens), an
EOF or reset (P died mid-stream), a FAIL frame (P ended the hold, or the layouts differ). A silent P is caught by
the socket timeout, which is always the pull's remaining time.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from fsm_pd.net.unix_sockets import is_unix, unix_path
from fsm_pd.transport.backends import tcp_wire as wire
from fsm_pd.transport.backends.base import (
    OnProgress,
    PageSource,
    StagingProgress,
    TransferFailed,
    TransferTimeout,
    check_uuid,
    live_staging,
)
from fsm_pd.transport.backends.holds import Hold
from fsm_pd.transport.backends.host_stream import HostEntry, HostStreamBackend, Landing
from fsm_pd.transport.backends.spec import layout_digest, summarize, verify_pulled
from fsm_pd.transport.backends.tcp_server import TcpPullServer


def parse_address(address: str) -> tuple[int, str | tuple[str, int]]:
    """``(socket family, address to connect to)`` of ``tcp://HOST:PORT`` or ``unix:PATH``."""
    if is_unix(address):
        return socket.AF_UNIX, unix_path(address)
    if not isinstance(address, str) or not address.startswith("tcp://"):
        raise TransferFailed(f"not a tcp backend address: {address!r}", "local")
    host, _, port = address[len("tcp://") :].rpartition(":")
    try:
        return (socket.AF_INET6 if ":" in host else socket.AF_INET), (host.strip("[]"), int(port))
    except ValueError:
        raise TransferFailed(f"not a tcp backend address: {address!r}", "local") from None


def connect(address: str, timeout_s: float) -> socket.socket:
    """A blocking connection to P's pull server at ``address`` (``tcp://`` or ``unix:``), connected within
    ``timeout_s``."""
    family, where = parse_address(address)
    if family != socket.AF_UNIX:
        return socket.create_connection(where, timeout=timeout_s)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        sock.connect(where)
    except BaseException:
        sock.close()
        raise
    return sock


# A pull that reports progress (a streamed write, which sums each landed piece for the KV checksum) lands a large
# frame in pieces of at most this much, each reported while it is still in cache (a core's L2 on the dev VM is 2 MiB)
LAND_STEP_BYTES = 1 << 20

class TcpTransferBackend(HostStreamBackend):
    name = "tcp"
    progressive = True
    sends_pages = True

    def __init__(self, *, frame_bytes: int = 4 << 20, max_streams: int = 256, **options: Any) -> None:
        """``frame_bytes`` caps one data frame (P sends less when less is final); ``max_streams`` caps the pulls P
        serves at once (a thread each; more are refused); ``options``: ``HostStreamBackend``'s (host,
        advertise_host, port, tombstone_ttl_s, recv_pool_bytes, serve)."""
        self._frame_bytes, self._max_streams = frame_bytes, max_streams
        super().__init__(**options)
        self._pulling: set[socket.socket] = set()

    def _make_server(self, host: str, port: int, uds: str | None) -> TcpPullServer:
        return TcpPullServer(self._holds.lookup, self._changed, host=host, port=port, uds=uds,
                             frame_bytes=self._frame_bytes, max_streams=self._max_streams)

    def parked_pulls(self) -> frozenset[int]:
        return frozenset() if self._server is None else self._server.parked()

    # ---- P side ----

    def publish(self, uuid: int, staging: Sequence[jax.Array], hold_timeout_s: float) -> None:
        check_uuid(uuid)
        self._require_server()
        arrays = live_staging(staging)
        entry = HostEntry.of(arrays)
        self._publish(uuid, entry, sum(entry.sizes), hold_timeout_s)

    def publish_progressive(self, uuid: int, host: np.ndarray, hold_timeout_s: float) -> StagingProgress:
        check_uuid(uuid)
        self._require_server()
        progress = StagingProgress(host, self._wake)
        self._publish(uuid, HostEntry.filling(progress), progress.nbytes, hold_timeout_s)
        return progress

    def publish_pages(self, uuid: int, source: PageSource, hold_timeout_s: float) -> None:
        check_uuid(uuid)
        self._require_server()
        self._publish(uuid, HostEntry.of_pages(source), source.nbytes, hold_timeout_s)

    def _publish(self, uuid: int, entry: HostEntry, nbytes: int, hold_timeout_s: float) -> None:
        with self._changed:
            self._holds.publish(uuid, nbytes, hold_timeout_s, lambda _deadline: entry)
            self._changed.notify_all()

    def _wake(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def _retire(self, uuid: int, reason: str, hold: Hold | None) -> None:
        # Under the table lock, which the condition shares. Frames already being sent keep their views alive.
        if self._server is not None:
            self._server.ended(uuid)
        self._changed.notify_all()

    # ---- D side ----

    def _pull(self, address: str, uuid: int, want: list, want_keys: list, deadline: float, timeout_s: float,
              on_progress: OnProgress | None) -> tuple[jax.Array, ...]:
        try:
            sock = connect(address, max(deadline - time.monotonic(), 0.001))
            sock.settimeout(None)  # blocking; every call is bounded by _arm instead
        except TimeoutError as exc:
            raise TransferTimeout(f"transfer {uuid}: connecting to {address} timed out") from exc
        except OSError as exc:  # refused, or no socket file: nobody listens there (P died or never started)
            raise TransferFailed(f"cannot connect to producer {address} for transfer {uuid}: {exc}") from exc
        landing = Landing(self._recv_pool, uuid, want, want_keys, on_progress)
        with sock:
            self._track(sock, True)
            try:
                if sock.family != socket.AF_UNIX:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                request = {"v": wire.PROTOCOL_VERSION, "uuid": uuid, "digest": layout_digest(want_keys),
                           "timeout_s": timeout_s}
                arrays = _receive(sock, request, landing, deadline)
            except (TimeoutError, BlockingIOError) as exc:  # BlockingIOError: SO_RCVTIMEO/SO_SNDTIMEO expired
                raise TransferTimeout(
                    f"transfer {uuid} from {address}: {landing.progress_text()} after {timeout_s:g} s") from exc
            except (OSError, ValueError) as exc:
                why = "this tcp backend was closed" if self._closed else f"producer {address} went away"
                raise TransferFailed(
                    f"transfer {uuid}: {why} ({landing.progress_text()}): {exc}", "local" if self._closed else "remote"
                ) from exc
            finally:
                self._track(sock, False)
        return verify_pulled(arrays, want, lambda exc: TransferFailed(f"transfer {uuid}: {exc}", "local"))

    def _track(self, sock: socket.socket, active: bool) -> None:
        with self._close_lock:
            (self._pulling.add if active else self._pulling.discard)(sock)

    def close(self) -> None:
        """End every hold, stop serving, and fail this backend's pulls in flight at once."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            pulling = list(self._pulling)
        for sock in pulling:  # their recv returns EOF; the pull raises TransferFailed
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._holds.close("producer closed")
        if self._server is not None:
            self._server.stop()


def _receive(sock: socket.socket, request: dict, landing: Landing, deadline: float) -> list[jax.Array]:
    """Send the request, then read frames until END; data bytes go to their place in ``landing``.

    The socket stays blocking and each call is bounded by SO_RCVTIMEO/SO_SNDTIMEO set to the time left, so that a
    large data frame is one ``recv_into(MSG_WAITALL)`` straight into place (a Python-level timeout would poll
    before every partial read, several hundred times per 64 MiB). Headers and small frames come through a small
    buffer instead: P sends a small transfer as one write, and one read then brings all of it.
    """
    _arm(sock, deadline)
    wire.send_request(sock, request)
    reader = _Reader(sock, deadline)
    while True:
        kind, length = wire.unpack_frame_header(reader.read(wire.FRAME_HEADER_BYTES))
        if kind == wire.DATA:
            if not 0 < length <= landing.room():
                raise TransferFailed(f"transfer {landing.uuid}: a {length}-byte frame does not fit the arrays")
            reader.read_into(landing, length)
        elif kind == wire.HEAD:
            landing.header(wire.unpack(reader.read(wire.check_message_length(length)))["arrays"])
        elif kind == wire.END:
            if not landing.complete:
                raise TransferFailed(f"transfer {landing.uuid}: producer ended the stream early")
            return landing.placed
        elif kind == wire.FAIL:
            body = wire.unpack(reader.read(wire.check_message_length(length)))
            reason = body.get("reason", "unknown failure")
            if body.get("published"):
                reason = f"{reason} for transfer {landing.uuid}: published {body['published']}, expected "
                reason += summarize(landing.want_keys)
            raise TransferFailed(reason, "local" if body.get("blame") == "local" else "remote")
        else:
            raise TransferFailed(f"transfer {landing.uuid}: unexpected frame {kind!r} from producer")


class _Reader:
    """Reads a pull's response through a 64 KiB buffer; large data goes around it, straight into place."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.deadline = sock, deadline
        self.buf = bytearray(64 << 10)
        self.view = memoryview(self.buf)
        self.start = self.end = 0  # buffered bytes: buf[start:end]

    def _recv_some(self) -> None:
        """One read into the buffer (after moving what is left to its front)."""
        if self.start:
            left = self.end - self.start
            self.buf[:left] = self.buf[self.start : self.end]
            self.start, self.end = 0, left
        _arm(self.sock, self.deadline)
        got = self.sock.recv_into(self.view[self.end :])
        if got == 0:
            raise wire.PeerClosed("connection closed mid-message")
        self.end += got

    def _take(self, out: memoryview) -> int:
        """Copy buffered bytes into ``out``; how many."""
        count = min(len(out), self.end - self.start)
        out[:count] = self.view[self.start : self.start + count]
        self.start += count
        return count

    def read(self, nbytes: int) -> bytes:
        out = memoryview(bytearray(nbytes))
        done = self._take(out)
        while done < nbytes:
            if nbytes - done > len(self.buf) // 2:
                done += self._recv_into(out[done:])
            else:
                self._recv_some()
                done += self._take(out[done:])
        return out.tobytes()

    def read_into(self, landing: Landing, nbytes: int) -> None:
        """``nbytes`` of data to their place in ``landing`` (one array: frames never span two)."""
        while nbytes:
            target = landing.target(min(nbytes, LAND_STEP_BYTES) if landing.on_progress is not None else nbytes)
            got = self._take(target)
            if not got:
                got = self._recv_into(target) if nbytes > len(self.buf) // 2 else 0
            if not got:
                self._recv_some()
                continue
            landing.landed(got)
            nbytes -= got

    def _recv_into(self, out: memoryview) -> int:
        _arm(self.sock, self.deadline)
        got = self.sock.recv_into(out, len(out), socket.MSG_WAITALL)
        if got == 0:
            raise wire.PeerClosed("connection closed mid-frame")
        return got


def _arm(sock: socket.socket, deadline: float) -> None:
    """Bound the next blocking socket call by the time left before ``deadline``."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("deadline passed")
    seconds = int(remaining)
    timeval = struct.pack("ll", seconds, max(1, int((remaining - seconds) * 1e6)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
