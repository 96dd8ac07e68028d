"""One process's side channel: a bound PULL socket read by a background thread, and cached PUSH sockets to peers.

Theory of operation. Every node binds one PULL socket (on 127.0.0.1 and a random port unless told otherwise) and
advertises its address (``SideChannel.address``); PREPARE carries D's address in ``reply_to`` and HEARTBEAT carries
the sender's in ``addr``, so nobody needs a fixed port. Sending connects a PUSH socket to the peer's address once and
caches it. A listener thread drains the PULL socket, runs each frame through ``open_frame`` (size, version, MAC,
body) and the ``ReplayGuard`` (freshness, nonce, duplicate), and hands what survives to ``on_message``. Everything
else is counted per reason (``dropped``) and logged at most once per ``log_interval_s`` per reason.

Bounded sends. The PUSH sockets set ``ZMQ_IMMEDIATE`` so that a frame is only queued on a live connection, and
``SNDTIMEO`` so that ``send`` waits at most ``send_timeout_s`` for one: a dead or absent peer makes ``send`` raise
``PeerUnreachable`` after that long, never block forever. The failed socket is then dropped, so the next send, e.g. to
a restarted peer at the same address, starts afresh (``forget_peer`` does the same on demand). A return from
``send`` means the frame was handed to a live connection, not that the peer processed it: acknowledgement is the
control plane's business (READY answers PREPARE, PULLED answers READY, ABORT_ACK answers ABORT). ``LINGER`` is
``linger_s``, so ``close`` waits that long at most for frames still in flight.

Threads. ``send``, ``forget_peer`` and ``close`` may be called from any thread; sends to different peers do not wait
for each other. ``on_message`` runs on the listener thread, one message at a time: it must hand work off, not do it.
An exception from it is logged and counted (``handler_errors``) and the listener carries on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from fsm_pd.transport.messages import MalformedMessage, Message, new_nonce
from fsm_pd.transport.rate_limit import RateLimiter
from fsm_pd.transport.replay_guard import (
    DEFAULT_MAX_DELIVERED,
    DEFAULT_MAX_NONCES,
    DEFAULT_MAX_SKEW_S,
    ReplayGuard,
)
from fsm_pd.transport.signing import (
    DEFAULT_MAX_FRAME_BYTES,
    REJECT_REASONS,
    RejectedFrame,
    check_secret,
    open_frame,
    seal,
)

log = logging.getLogger(__name__)

DROP_REASONS = (*REJECT_REASONS, "malformed", "stale", "replayed", "duplicate")
_POLL_MS = 50  # how quickly the listener notices close(); idle cost is 20 wake-ups a second
_PEER_SCHEMES = ("tcp://", "ipc://")


class SideChannelError(Exception):
    """Base of the errors ``SideChannel`` raises."""


class PeerUnreachable(SideChannelError):
    """The peer did not take the frame within ``send_timeout_s`` (dead, not yet started, or gone)."""


class BadPeerAddress(SideChannelError, ValueError):
    """The address is not one this channel can connect to (addresses arrive in messages: treat them as input)."""


class MessageTooLarge(SideChannelError, ValueError):
    """The encoded frame exceeds ``max_frame_bytes``; a peer with the same limit would drop it."""


class ChannelClosed(SideChannelError):
    """The channel was closed."""


@dataclass(eq=False)
class _Peer:
    socket: zmq.Socket | None
    lock: threading.Lock = field(default_factory=threading.Lock)


class SideChannel:
    """Signed, bounded, deduplicated messaging between fsm-pd nodes. See the module docstring."""

    def __init__(
        self,
        *,
        node_id: str,
        secret: bytes,
        on_message: Callable[[Message], None],
        bind: str = "tcp://127.0.0.1:0",
        advertise_host: str | None = None,
        send_timeout_s: float = 1.0,
        linger_s: float = 0.2,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        max_skew_s: float = DEFAULT_MAX_SKEW_S,
        max_nonces: int = DEFAULT_MAX_NONCES,
        max_delivered: int = DEFAULT_MAX_DELIVERED,
        clock: Callable[[], float] = time.time,
        log_interval_s: float = 10.0,
    ) -> None:
        self.node_id = node_id
        self._secret = check_secret(secret)
        self._on_message = on_message
        self._send_timeout_ms = max(1, round(send_timeout_s * 1000))
        self._linger_ms = max(0, round(linger_s * 1000))
        self._max_frame_bytes = max_frame_bytes
        self._clock = clock
        self._guard = ReplayGuard(max_skew_s=max_skew_s, max_nonces=max_nonces, max_delivered=max_delivered)
        self._log_limiter = RateLimiter(log_interval_s)

        self._counter_lock = threading.Lock()
        self._dropped = dict.fromkeys(DROP_REASONS, 0)
        self._delivered = 0
        self._handler_errors = 0

        self._ctx = zmq.Context()
        self._peers: dict[str, _Peer] = {}
        self._peers_lock = threading.Lock()
        self._closed = False
        self._closed_from_listener = False
        self._stop = threading.Event()
        self._inbox = self._ctx.socket(zmq.PULL)
        try:
            self._inbox.setsockopt(zmq.LINGER, 0)
            # libzmq's own cap, a backstop for memory only: it cuts the sender's connection without telling us, so it
            # sits well above max_frame_bytes and the counted "oversized" check below does the real work.
            self._inbox.setsockopt(zmq.MAXMSGSIZE, 4 * max_frame_bytes)
            # zmq spells "any free port" as "*"; accept the more familiar ":0" too.
            self._inbox.bind(bind[:-2] + ":*" if bind.endswith(":0") else bind)
            endpoint = self._inbox.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            self._inbox.close()
            self._ctx.term()
            raise
        if advertise_host is not None and endpoint.startswith("tcp://"):
            scheme_host, port = endpoint.rsplit(":", 1)
            endpoint = f"{scheme_host.split('://', 1)[0]}://{advertise_host}:{port}"
        self.address = endpoint
        # The PULL socket belongs to the listener thread from here on.
        self._thread = threading.Thread(target=self._listen, name=f"side-channel[{node_id}]", daemon=True)
        self._thread.start()

    # -- sending ----------------------------------------------------------------------------------------------------

    def stamp(self, cls: type[Message], **fields_: Any) -> Message:
        """Build a message of class ``cls`` from this node, with a fresh nonce and the current time."""
        return cls(sender=self.node_id, nonce=new_nonce(), sent_at=self._clock(), **fields_)

    def send(self, addr: str, msg: Message) -> None:
        """Sign and send ``msg`` to the side channel at ``addr``; returns once a live connection took the frame.

        Raises ``PeerUnreachable`` after at most ``send_timeout_s`` if none did, ``BadPeerAddress``,
        ``MessageTooLarge`` or ``ChannelClosed``.
        """
        frame = seal(msg, self._secret)
        if len(frame) > self._max_frame_bytes:
            raise MessageTooLarge(f"{msg.TYPE.name} frame is {len(frame)} bytes > {self._max_frame_bytes}")
        peer = self._peer(addr)
        with peer.lock:
            if peer.socket is None:  # closed or forgotten by another thread between lookup and lock
                if self._closed:
                    raise ChannelClosed(f"side channel of {self.node_id} is closed")
                raise PeerUnreachable(f"{addr}: connection was dropped while sending")
            try:
                peer.socket.send(frame)
                return
            except zmq.Again:
                problem = f"no live connection within {self._send_timeout_ms} ms"
            except zmq.ZMQError as exc:
                problem = str(exc)
        self._forget(addr, peer)
        raise PeerUnreachable(f"{addr}: {problem}")

    def forget_peer(self, addr: str) -> None:
        """Close and drop the cached socket for ``addr``; the next send connects afresh. No-op if none is cached."""
        self._forget(addr, None)

    def _forget(self, addr: str, only: _Peer | None) -> None:
        # ``only``: drop the entry only if it is still this one, not a fresh socket another thread made meanwhile.
        with self._peers_lock:
            peer = self._peers.get(addr)
            if peer is None or (only is not None and peer is not only):
                return
            del self._peers[addr]
        with peer.lock:
            if peer.socket is not None:
                peer.socket.close(linger=0)  # it failed or its peer is gone: nothing in it is worth waiting for
                peer.socket = None

    def _peer(self, addr: str) -> _Peer:
        if not isinstance(addr, str) or not addr.startswith(_PEER_SCHEMES):
            raise BadPeerAddress(f"not a tcp:// or ipc:// address: {addr!r:.100}")
        with self._peers_lock:
            if self._closed:
                raise ChannelClosed(f"side channel of {self.node_id} is closed")
            peer = self._peers.get(addr)
            if peer is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only on a live connection, so a dead peer times out
                sock.setsockopt(zmq.SNDTIMEO, self._send_timeout_ms)
                sock.setsockopt(zmq.LINGER, self._linger_ms)
                sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
                try:
                    sock.connect(addr)
                except zmq.ZMQError as exc:
                    sock.close(linger=0)
                    raise BadPeerAddress(f"cannot connect to {addr!r:.100}: {exc}") from None
                peer = self._peers[addr] = _Peer(sock)
            return peer

    # -- receiving --------------------------------------------------------------------------------------------------

    def _listen(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._inbox.poll(_POLL_MS):
                    continue
                while not self._stop.is_set():
                    try:
                        parts = self._inbox.recv_multipart(zmq.NOBLOCK, copy=True)
                    except zmq.Again:
                        break
                    try:
                        self._handle(parts)
                    except Exception:  # a bug of ours on some input: count it against the frame, keep listening
                        self._drop("malformed", "internal error while handling a frame")
                        log.exception("side channel %s: internal error while handling a frame", self.node_id)
        finally:
            self._inbox.close(linger=0)
            if self._closed_from_listener:
                self._ctx.term()  # close() ran inside on_message and left this last step to us

    def _handle(self, parts: list[bytes]) -> None:
        now = self._clock()
        if len(parts) != 1:
            self._drop("malformed", f"{len(parts)}-part message (frames are single-part)")
            return
        try:
            msg = open_frame(parts[0], self._secret, self._max_frame_bytes)
        except RejectedFrame as exc:
            self._drop(exc.reason, str(exc))
            return
        except MalformedMessage as exc:
            self._drop("malformed", str(exc))
            return
        reason = self._guard.check(msg, now)
        if reason is not None:
            self._drop(reason, f"{msg.TYPE.name} room={msg.room} from {msg.sender!r:.64} sent_at={msg.sent_at:.3f}")
            return
        with self._counter_lock:
            self._delivered += 1
        try:
            self._on_message(msg)
        except Exception:
            with self._counter_lock:
                self._handler_errors += 1
            if self._log_limiter.allow("handler_error", self._clock()) is not None:
                log.exception(
                    "side channel %s: on_message raised for %s room=%s", self.node_id, msg.TYPE.name, msg.room
                )

    def _drop(self, reason: str, detail: str) -> None:
        with self._counter_lock:
            self._dropped[reason] += 1
        suppressed = self._log_limiter.allow(reason, self._clock())
        if suppressed is not None:
            level = logging.INFO if reason == "duplicate" else logging.WARNING
            log.log(
                level,
                "side channel %s dropped a frame (%s): %s%s",
                self.node_id,
                reason,
                detail,
                f" [{suppressed} more since last report]" if suppressed else "",
            )

    # -- state ------------------------------------------------------------------------------------------------------

    @property
    def dropped(self) -> dict[str, int]:
        """Frames dropped so far, per reason (every reason in ``DROP_REASONS`` is present)."""
        with self._counter_lock:
            return dict(self._dropped)

    @property
    def delivered(self) -> int:
        with self._counter_lock:
            return self._delivered

    @property
    def handler_errors(self) -> int:
        with self._counter_lock:
            return self._handler_errors

    def close(self) -> None:
        """Stop the listener, close every socket and the context. Idempotent; bounded by about ``linger_s``."""
        with self._peers_lock:
            if self._closed:
                return
            self._closed = True
            peers, self._peers = list(self._peers.values()), {}
        in_listener = threading.current_thread() is self._thread
        self._closed_from_listener = in_listener
        self._stop.set()
        if not in_listener:  # from on_message the loop exits by itself once the handler returns
            self._thread.join()
        for peer in peers:
            with peer.lock:
                if peer.socket is not None:
                    peer.socket.close()  # with the socket's LINGER: in-flight frames get linger_s to leave
                    peer.socket = None
        if not in_listener:
            self._ctx.term()

    def __enter__(self) -> SideChannel:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
