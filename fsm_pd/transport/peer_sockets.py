"""The side channel's outgoing half: one cached PUSH socket per peer address, with bounded and with non-blocking sends.

Every socket sets ``ZMQ_IMMEDIATE``, so a frame is queued only on a live connection: a dead or absent peer makes a
blocking ``send`` wait at most ``SNDTIMEO`` and raise ``PeerUnreachable``, and makes ``try_send`` return False at
once. After a failed blocking send the socket is dropped, so the next send, e.g. to a peer restarted at the same
address, connects afresh. ``try_send`` keeps the socket when it finds no connection: that is the normal state of a
socket that was just created and is connecting in the background.

Sends to one peer are serialised by that peer's lock; sends to different peers do not wait for each other.
``try_send`` does not wait for the lock either: if a blocking send to the same peer is under way, it returns False.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import zmq

from fsm_pd.transport.errors import (  # noqa: F401 - raised here, and re-exported for the channel
    BadPeerAddress,
    ChannelClosed,
    MessageTooLarge,
    PeerUnreachable,
    SideChannelError,
)

PEER_SCHEMES = ("tcp://", "ipc://")


@dataclass(eq=False)
class _Peer:
    socket: zmq.Socket | None
    lock: threading.Lock = field(default_factory=threading.Lock)


class PeerSockets:
    def __init__(self, ctx: zmq.Context, *, owner: str, send_timeout_ms: int, linger_ms: int):
        self._ctx, self._owner = ctx, owner
        self._send_timeout_ms, self._linger_ms = send_timeout_ms, linger_ms
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self.closed = False

    def send(self, addr: str, frame: bytes) -> None:
        """Hand ``frame`` to a live connection to ``addr`` within ``send_timeout_ms``, or raise."""
        peer = self._peer(addr)
        with peer.lock:
            if peer.socket is None:  # closed or forgotten by another thread between lookup and lock
                if self.closed:
                    raise ChannelClosed(f"side channel of {self._owner} is closed")
                raise PeerUnreachable(f"{addr}: connection was dropped while sending")
            try:
                peer.socket.send(frame)
                return
            except zmq.Again:
                problem = f"no live connection within {self._send_timeout_ms} ms"
            except zmq.ZMQError as exc:
                problem = str(exc)
        self.forget(addr, peer)
        raise PeerUnreachable(f"{addr}: {problem}")

    def try_send(self, addr: str, frame: bytes) -> bool:
        """Hand ``frame`` to a live connection to ``addr`` if that needs no wait; False otherwise."""
        peer = self._peer(addr)
        if not peer.lock.acquire(blocking=False):
            return False  # a blocking send to this peer is under way; waiting for it is what we must not do
        try:
            if peer.socket is None:
                return False
            try:
                peer.socket.send(frame, zmq.NOBLOCK)
                return True
            except zmq.Again:
                return False  # no live connection yet: keep the socket, it is connecting or reconnecting
            except zmq.ZMQError:
                pass
        finally:
            peer.lock.release()
        self.forget(addr, peer)
        return False

    def forget(self, addr: str, only: _Peer | None = None) -> None:
        """Close and drop the socket for ``addr``. ``only``: drop it only if it is still this one, not a fresh
        socket another thread made meanwhile."""
        with self._lock:
            peer = self._peers.get(addr)
            if peer is None or (only is not None and peer is not only):
                return
            del self._peers[addr]
        with peer.lock:
            if peer.socket is not None:
                peer.socket.close(linger=0)  # it failed or its peer is gone: nothing in it is worth waiting for
                peer.socket = None

    def __contains__(self, addr: str) -> bool:
        with self._lock:
            return addr in self._peers

    def _peer(self, addr: str) -> _Peer:
        if not isinstance(addr, str) or not addr.startswith(PEER_SCHEMES):
            raise BadPeerAddress(f"not a tcp:// or ipc:// address: {addr!r:.100}")
        with self._lock:
            if self.closed:
                raise ChannelClosed(f"side channel of {self._owner} is closed")
            peer = self._peers.get(addr)
            if peer is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only on a live connection, so a dead peer times out
                sock.setsockopt(zmq.SNDTIMEO, self._send_timeout_ms)
                sock.setsockopt(zmq.LINGER, self._linger_ms)
                sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
                if "[" in addr:  # an IPv6 literal: zmq connects only IPv4 unless told
                    sock.setsockopt(zmq.IPV6, 1)
                try:
                    sock.connect(addr)
                except zmq.ZMQError as exc:
                    sock.close(linger=0)
                    raise BadPeerAddress(f"cannot connect to {addr!r:.100}: {exc}") from None
                peer = self._peers[addr] = _Peer(sock)
            return peer

    def mark_closed(self) -> bool:
        """Refuse new sockets from now on; False if this was done before."""
        with self._lock:
            if self.closed:
                return False
            self.closed = True
            return True

    def close_all(self) -> None:
        """Close every socket, letting each linger ``linger_ms`` for frames in flight. Call after ``mark_closed``."""
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            with peer.lock:
                if peer.socket is not None:
                    peer.socket.close()
                    peer.socket = None
