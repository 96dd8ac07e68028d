"""One process's side channel: a bound PULL socket read by a background thread, and cached PUSH sockets to peers.

Theory of operation. Every node binds one PULL socket (on 127.0.0.1 and a random port unless told otherwise, or on a
unix socket, ``ipc://PATH``, whose file it removes when it closes) and advertises its address (``SideChannel.address``:
the bound endpoint, with ``advertise_host`` in place of its host when the node binds a wildcard or an address its peers
cannot reach). Before binding ``tcp://`` it checks with a plain socket that the host allows TCP at all: where it does
not, libzmq would abort the process, and a ``TcpRefused`` error says so instead. Every message it stamps carries that
address as ``origin``, its node id as ``sender`` and its process's ``instance``, so a receiver knows who spoke, where to
answer and whether the peer at that address is still the process it was talking to; nobody needs a fixed port. Sending
connects a PUSH socket to the peer's address once and caches it. A listener thread drains the PULL socket, runs each
frame through ``open_frame`` (size, version, MAC, body) and the ``ReplayGuard`` (freshness, nonce, duplicate), and hands
what survives to the observers and then to ``on_message``. Everything else is counted per reason (``dropped``) and
logged at most once per ``log_interval_s`` per reason.

Heartbeats belong to the channel. A HEARTBEAT ping is answered with a pong to its ``origin`` (while ``healthy()``
says so) and ``ping(addr)`` sends one; both go out without blocking (``try_send``, then the ``Courier`` thread).
Pings and pongs reach the observers (``add_observer``: a ``PeerMonitor``) but never ``on_message``, which sees only
room messages.

Bounded sends. The PUSH sockets set ``ZMQ_IMMEDIATE`` so that a frame is only queued on a live connection, and
``SNDTIMEO`` so that ``send`` waits at most ``send_timeout_s`` for one: a dead or absent peer makes ``send`` raise
``PeerUnreachable`` after that long, never block forever. The failed socket is then dropped, so the next send, e.g. to
a restarted peer at the same address, starts afresh (``forget_peer`` does the same on demand). ``try_send`` never
waits: it returns False where ``send`` would have waited. A return from ``send`` means the frame was handed to a live
connection, not that the peer processed it: acknowledgement is the control plane's business (READY answers PREPARE,
PULLED answers READY, a pong answers a ping). ``LINGER`` is ``linger_s``, so ``close`` waits that long at most for
frames still in flight.

Threads. ``send``, ``try_send``, ``ping``, ``forget_peer`` and ``close`` may be called from any thread; sends to
different peers do not wait for each other. Observers and ``on_message`` run on the listener thread, one message at
a time: they must hand work off, not do it. An exception from one is logged and counted (``handler_errors``) and the
listener carries on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from fsm_pd.net.unix_sockets import ipc_file, prepare_zmq_bind, remove_socket
from fsm_pd.transport.addresses import with_host
from fsm_pd.transport.courier import Courier
from fsm_pd.transport.messages import Heartbeat, MalformedMessage, Message, new_instance_id, new_nonce
from fsm_pd.transport.peer_sockets import (
    BadPeerAddress,
    ChannelClosed,
    MessageTooLarge,
    PeerSockets,
    PeerUnreachable,
    SideChannelError,
)
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

__all__ = ["DROP_REASONS", "BadPeerAddress", "ChannelClosed", "MessageTooLarge", "PeerUnreachable", "SideChannel",
           "SideChannelError"]

log = logging.getLogger(__name__)

DROP_REASONS = (*REJECT_REASONS, "malformed", "stale", "replayed", "duplicate")
_POLL_MS = 50  # how quickly the listener notices close(); idle cost is 20 wake-ups a second


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
        instance: str | None = None,
        healthy: Callable[[], bool] | None = None,
        heartbeat_timeout_s: float = 0.5,
    ) -> None:
        """``instance``: this process's instance id (default: a new one). ``healthy``: pings are answered only while
        it returns True; wire it to the node loop's health, so that peers declare a node with a dead loop dead.
        ``heartbeat_timeout_s``: how long a ping or pong may wait for a connection before it is dropped."""
        self.node_id = node_id
        self.instance = new_instance_id() if instance is None else instance
        if not isinstance(self.instance, str) or not self.instance:
            raise ValueError(f"instance must be a non-empty string, got {self.instance!r:.80}")
        self._secret = check_secret(secret)
        self._on_message = on_message
        self._healthy = healthy
        self._observers: tuple[Callable[[Message], None], ...] = ()
        self._observers_lock = threading.Lock()
        self._max_frame_bytes = max_frame_bytes
        self._clock = clock
        self._guard = ReplayGuard(max_skew_s=max_skew_s, max_nonces=max_nonces, max_delivered=max_delivered)
        self._log_limiter = RateLimiter(log_interval_s)

        self._counter_lock = threading.Lock()
        self._dropped = dict.fromkeys(DROP_REASONS, 0)
        self._delivered = 0
        self._handler_errors = 0

        prepare_zmq_bind(bind, f"the side channel of {node_id}")  # a Python error where libzmq would abort
        self._ctx = zmq.Context()
        self._peers = PeerSockets(self._ctx, owner=node_id, send_timeout_ms=max(1, round(send_timeout_s * 1000)),
                                  linger_ms=max(0, round(linger_s * 1000)))
        self._closed_from_listener = False
        self._stop = threading.Event()
        self._inbox = self._ctx.socket(zmq.PULL)
        try:
            self._inbox.setsockopt(zmq.LINGER, 0)
            # libzmq's own cap, a backstop for memory only: it cuts the sender's connection without telling us, so it
            # sits well above max_frame_bytes and the counted "oversized" check below does the real work.
            self._inbox.setsockopt(zmq.MAXMSGSIZE, 4 * max_frame_bytes)
            if "[" in bind:  # an IPv6 literal; set only then, as it makes an IPv4 bind report [::ffff:a.b.c.d]
                self._inbox.setsockopt(zmq.IPV6, 1)
            # zmq spells "any free port" as "*"; accept the more familiar ":0" too.
            self._inbox.bind(bind[:-2] + ":*" if bind.endswith(":0") else bind)
            endpoint = self._inbox.getsockopt_string(zmq.LAST_ENDPOINT)
            self._ipc_file = ipc_file(endpoint)  # removed on close: libzmq leaves it behind
        except zmq.ZMQError:
            self._inbox.close()
            self._ctx.term()
            raise
        if advertise_host is not None and endpoint.startswith("tcp://"):
            endpoint = with_host(endpoint, advertise_host)
        self.address = endpoint
        self._courier = Courier(self._peers.try_send, timeout_s=heartbeat_timeout_s,
                                name=f"side-channel-courier[{node_id}]", on_expired=self._peers.forget)
        # The PULL socket belongs to the listener thread from here on.
        self._thread = threading.Thread(target=self._listen, name=f"side-channel[{node_id}]", daemon=True)
        self._thread.start()

    # -- sending ----------------------------------------------------------------------------------------------------

    def stamp(self, cls: type[Message], **fields_: Any) -> Message:
        """Build a message of class ``cls`` from this node (its id, instance and address), with a fresh nonce and
        the current time."""
        return cls(sender=self.node_id, instance=self.instance, origin=self.address, nonce=new_nonce(),
                   sent_at=self._clock(), **fields_)

    def send(self, addr: str, msg: Message) -> None:
        """Sign and send ``msg`` to the side channel at ``addr``; returns once a live connection took the frame.

        Raises ``PeerUnreachable`` after at most ``send_timeout_s`` if none did, ``BadPeerAddress``,
        ``MessageTooLarge`` or ``ChannelClosed``.
        """
        self._peers.send(addr, self._seal(msg))

    def try_send(self, addr: str, msg: Message) -> bool:
        """Sign and send ``msg`` only if that needs no wait: True if a live connection took the frame, False if there
        is none yet (the first send to an address connects in the background) or another thread is sending to that
        peer. Raises ``BadPeerAddress``, ``MessageTooLarge`` or ``ChannelClosed``, as ``send`` does."""
        return self._peers.try_send(addr, self._seal(msg))

    def ping(self, addr: str) -> None:
        """Send a HEARTBEAT ping to ``addr`` without waiting; the pong reaches the observers. Raises
        ``BadPeerAddress`` or ``ChannelClosed``; an unreachable peer just does not answer."""
        self._post_heartbeat(addr, pong=False)

    def forget_peer(self, addr: str) -> None:
        """Close and drop the cached socket for ``addr``; the next send connects afresh. No-op if none is cached."""
        self._peers.forget(addr)

    def _post_heartbeat(self, addr: str, *, pong: bool) -> None:
        frame = self._seal(self.stamp(Heartbeat, room=0, pong=pong))
        if not self._peers.try_send(addr, frame):
            self._courier.post(addr, pong, frame)

    def _seal(self, msg: Message) -> bytes:
        frame = seal(msg, self._secret)
        if len(frame) > self._max_frame_bytes:
            raise MessageTooLarge(f"{msg.TYPE.name} frame is {len(frame)} bytes > {self._max_frame_bytes}")
        return frame

    # -- receiving --------------------------------------------------------------------------------------------------

    def add_observer(self, observer: Callable[[Message], None]) -> None:
        """Call ``observer(msg)`` on the listener thread for every delivered message, heartbeats included, before
        ``on_message``. It must not block (a ``PeerMonitor`` only notes who was heard)."""
        with self._observers_lock:
            self._observers = (*self._observers, observer)

    def remove_observer(self, observer: Callable[[Message], None]) -> None:
        with self._observers_lock:
            self._observers = tuple(o for o in self._observers if o != observer)  # == : bound methods are rebuilt

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
        self.deliver(msg, now)

    def deliver(self, msg: Message, now: float | None = None) -> None:
        """Take ``msg`` as if its frame had arrived and opened: the replay guard, the observers, ``on_message``. The
        listener calls it for every frame; an engine of the same process calls it directly (``InProcessSenders``:
        no socket, no MAC, no thread hop)."""
        now = self._clock() if now is None else now
        reason = self._guard.check(msg, now)
        if reason is not None:
            self._drop(reason, f"{msg.TYPE.name} room={msg.room} from {msg.sender!r:.64} sent_at={msg.sent_at:.3f}")
            return
        with self._counter_lock:
            self._delivered += 1
        is_heartbeat = isinstance(msg, Heartbeat)
        for observer in self._observers:  # before a ping's pong: whoever hears the pong knows the ping was seen
            self._call(observer, msg)
        if is_heartbeat and not msg.pong and (self._healthy is None or self._healthy()):
            self._answer(msg)
        if not is_heartbeat:
            self._call(self._on_message, msg)

    def _answer(self, ping: Heartbeat) -> None:
        try:
            self._post_heartbeat(ping.origin, pong=True)
        except SideChannelError as exc:  # an origin we cannot connect to, or we are closing
            if self._log_limiter.allow("unanswerable_ping", self._clock()) is not None:
                log.warning("side channel %s: cannot answer a ping from %r: %s", self.node_id, ping.sender, exc)

    def _call(self, handler: Callable[[Message], None], msg: Message) -> None:
        try:
            handler(msg)
        except Exception:
            with self._counter_lock:
                self._handler_errors += 1
            if self._log_limiter.allow("handler_error", self._clock()) is not None:
                log.exception("side channel %s: a handler raised for %s room=%s", self.node_id, msg.TYPE.name,
                              msg.room)

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

    @property
    def unsent_heartbeats(self) -> int:
        """Pings and pongs dropped because no connection to their peer came up within ``heartbeat_timeout_s``."""
        return self._courier.expired

    def close(self) -> None:
        """Stop the listener, close every socket and the context. Idempotent; bounded by about ``linger_s``."""
        if not self._peers.mark_closed():
            return
        in_listener = threading.current_thread() is self._thread
        self._closed_from_listener = in_listener
        self._stop.set()
        if not in_listener:  # from on_message the loop exits by itself once the handler returns
            self._thread.join()
        self._courier.close()
        self._peers.close_all()  # with each socket's LINGER: in-flight frames get linger_s to leave
        if not in_listener:
            self._ctx.term()
        if self._ipc_file is not None:
            remove_socket(*self._ipc_file)

    def __enter__(self) -> SideChannel:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
