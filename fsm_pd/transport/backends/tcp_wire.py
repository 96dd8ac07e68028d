"""Wire format of the ``tcp`` backend: one TCP connection per pull, one request, then typed frames.

D -> P, once::

    u32 length, msgpack {v, uuid, digest, timeout_s}

P -> D, frames of ``u8 kind, u64 length, payload``::

    H  msgpack {arrays: [[shape, dtype], ...]}    # what P published; D checks it against its spec
    D  raw bytes                                  # the arrays' bytes, in order; a frame never spans two arrays
    E  (empty)                                    # all bytes sent
    F  msgpack {reason, blame, published}         # at any point, instead of the next frame

TCP's own flow control paces the stream, so there are no credits: D reads each data frame straight into the place
where its bytes belong (``recv_into``), which is the same single copy a plain socket makes.
"""

from __future__ import annotations

import socket
import struct

# The same msgpack bodies as the zmq wire (zmq_wire imports no zmq); re-exported so that callers use tcp_wire alone.
from fsm_pd.transport.backends.zmq_wire import pack, unpack  # noqa: F401

PROTOCOL_VERSION = 1
HEAD, DATA, END, FAIL = b"H", b"D", b"E", b"F"
MAX_REQUEST_BYTES = 64 << 10
MAX_MESSAGE_BYTES = 1 << 20  # a header or failure; data frames are bounded by the announced arrays instead
_REQUEST = struct.Struct("<I")
_FRAME = struct.Struct("<cQ")
FRAME_HEADER_BYTES = _FRAME.size


class PeerClosed(ConnectionError):
    """The other end closed the connection before a whole message arrived."""


def recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    buf = bytearray(nbytes)
    view, got = memoryview(buf), 0
    while got < nbytes:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise PeerClosed(f"connection closed after {got} of {nbytes} bytes")
        got += n
    return bytes(buf)


def send_request(sock: socket.socket, request: dict) -> None:
    body = pack(request)
    sock.sendall(_REQUEST.pack(len(body)) + body)


def read_request(sock: socket.socket) -> dict:
    """One read brings the whole request in the usual case (D sends it in one write)."""
    data = sock.recv(_REQUEST.size + 4096)
    while len(data) < _REQUEST.size:
        data += _recv_more(sock, _REQUEST.size - len(data))
    (length,) = _REQUEST.unpack(data[: _REQUEST.size])
    if length > MAX_REQUEST_BYTES:
        raise ValueError(f"request of {length} bytes is over the {MAX_REQUEST_BYTES}-byte limit")
    if len(data) > _REQUEST.size + length:
        raise ValueError("bytes after the request: a pull sends one request and then waits")
    body = data[_REQUEST.size :]
    if len(body) < length:
        body += recv_exact(sock, length - len(body))
    return unpack(body)


def _recv_more(sock: socket.socket, nbytes: int) -> bytes:
    data = sock.recv(nbytes)
    if not data:
        raise PeerClosed("connection closed before the request was complete")
    return data


def frame_header(kind: bytes, length: int) -> bytes:
    return _FRAME.pack(kind, length)


def send_message(sock: socket.socket, kind: bytes, body: dict | None = None) -> None:
    payload = b"" if body is None else pack(body)
    sock.sendall(frame_header(kind, len(payload)) + payload)


def unpack_frame_header(data: bytes) -> tuple[bytes, int]:
    return _FRAME.unpack(data)


def check_message_length(length: int) -> int:
    if length > MAX_MESSAGE_BYTES:
        raise ValueError(f"message of {length} bytes is over the {MAX_MESSAGE_BYTES}-byte limit")
    return length
