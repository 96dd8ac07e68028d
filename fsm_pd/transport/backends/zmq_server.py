"""P side of the zmq backend: one thread that owns a ROUTER socket and streams published entries to pullers.

The thread never blocks on a peer: each pull is a credit-paced stream, so a slow or vanished D costs one table
entry until its own deadline, not a stuck server. Chunks are zero-copy views of the host copy of the staging
arrays (``copy=False``); zmq keeps each view alive until its bytes are on the wire. Other threads talk to the
server only through ``notify`` (a queue plus a wake-up pipe), so the socket stays single-threaded.
"""

from __future__ import annotations

import logging
import os
import queue
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from fsm_pd.net.unix_sockets import ipc_address, ipc_file, prepare_zmq_bind, remove_socket
from fsm_pd.transport.addresses import is_ipv6, with_port
from fsm_pd.transport.backends import zmq_wire as wire
from fsm_pd.transport.backends.host_stream import HostEntry

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Stream:
    uuid: int
    entry: HostEntry
    plan: list[tuple[int, int, int]]
    credits: int
    expires: float  # the puller's own deadline: after it nobody is listening
    next_chunk: int = 0


class ZmqPullServer:
    def __init__(
        self,
        lookup: Callable[[int], tuple[HostEntry | None, str | None]],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        uds: str | None = None,
        chunk_bytes: int = 512 << 10,
    ) -> None:
        """``lookup(uuid)`` returns ``(entry, None)`` for a live hold, ``(None, reason)`` for an ended one, else
        ``(None, None)``. ``uds``: bind that unix socket (``ipc://PATH``) instead of ``host:port``."""
        self._lookup = lookup
        self._chunk_bytes = chunk_bytes
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished peer raises instead of vanishing
        self._sock.setsockopt(zmq.SNDHWM, 0)  # credits bound what is queued, not the high-water mark
        if is_ipv6(host):  # only then: with it, an IPv4 bind would report its endpoint as [::ffff:a.b.c.d]
            self._sock.setsockopt(zmq.IPV6, 1)
        endpoint = ipc_address(uds) if uds is not None else f"tcp://{with_port(host, port)}"
        prepare_zmq_bind(endpoint, "the zmq transfer backend")  # a Python error where libzmq would abort
        self._sock.bind(endpoint)
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._ipc_file = ipc_file(self.address)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._commands: queue.SimpleQueue[tuple[str, int, str]] = queue.SimpleQueue()
        self._streams: dict[bytes, _Stream] = {}
        self._parked: dict[int, dict[bytes, tuple[wire.PullRequest, float]]] = {}
        self.parked: frozenset[int] = frozenset()  # _parked's uuids, for other threads: renewed after each round
        self._delivered: set[int] = set()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"fsm-pd-zmq-server {self.address}", daemon=True)
        self._thread.start()

    # ---- called from other threads ----

    def notify(self, event: str, uuid: int, reason: str = "") -> None:
        """``"published"`` serves pulls parked on ``uuid``; ``"ended"`` aborts its streams with ``reason``;
        ``"filled"`` says more bytes of a progressive entry are final."""
        if self._stopping:  # e.g. a fail() after close: nobody is served any more
            return
        self._commands.put((event, uuid, reason))
        os.write(self._wake_w, b"x")

    def stop(self) -> None:
        if not self._stopping:
            self._stopping = True
            os.write(self._wake_w, b"x")
            self._thread.join(timeout=5)
            os.close(self._wake_r)
            os.close(self._wake_w)

    # ---- server thread ----

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while not self._stopping:
                events = dict(poller.poll(self._poll_timeout_ms()))
                if self._wake_r in events:
                    self._drain_commands()
                if self._sock in events:
                    self._drain_requests()
                self._pump()
                self._expire(time.monotonic())
                self.parked = frozenset(self._parked)
        except Exception:
            log.exception("zmq pull server %s crashed", self.address)
        finally:
            self._sock.close(linger=0)
            self._ctx.term()
            if self._ipc_file is not None:
                remove_socket(*self._ipc_file)  # libzmq leaves the file behind

    def _poll_timeout_ms(self) -> int:
        # Only deadlines need the timeout; all real work is driven by socket or wake-up events.
        return 100 if self._streams or self._parked else 1000

    def _drain_commands(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                event, uuid, reason = self._commands.get_nowait()
            except queue.Empty:
                return
            if event == "published":
                for identity, (request, expires) in self._parked.pop(uuid, {}).items():
                    self._start(identity, request, expires)
            elif event == "filled":
                pass  # _pump runs after every wake-up and sends whatever became final
            elif event == "ended":
                self._delivered.discard(uuid)
                for identity, stream in list(self._streams.items()):
                    if stream.uuid == uuid:
                        self._fail(identity, f"transfer {uuid} {reason}")
                for identity in self._parked.pop(uuid, {}):
                    self._fail(identity, f"transfer {uuid} {reason}")

    def _drain_requests(self) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) < 2:
                continue
            identity, kind, body = frames[0], frames[1], frames[2] if len(frames) > 2 else b""
            try:
                if kind == wire.CREDIT:
                    stream = self._streams.get(identity)
                    if stream is not None:
                        stream.credits += wire.unpack_u32(body)
                elif kind == wire.PULL:
                    request = wire.PullRequest.parse(body)
                    self._start(identity, request, time.monotonic() + request.timeout_s)
            except (ValueError, TypeError, struct.error) as exc:  # msgpack's errors are ValueErrors
                self._fail(identity, f"malformed request: {exc}", blame="local")

    def _start(self, identity: bytes, request: wire.PullRequest, expires: float) -> None:
        if request.v != wire.PROTOCOL_VERSION:
            self._fail(identity, f"protocol version {request.v} != {wire.PROTOCOL_VERSION}", blame="local")
            return
        uuid = request.uuid
        entry, ended = self._lookup(uuid)
        if ended is not None:
            self._fail(identity, f"transfer {uuid} {ended}")
        elif entry is None:  # not published yet: park until it is, or until the puller's deadline
            self._parked.setdefault(uuid, {})[identity] = (request, expires)
        elif uuid in self._delivered:
            self._fail(identity, f"transfer {uuid} was already pulled and awaits release")
        elif request.digest != entry.digest:
            self._fail(identity, "spec mismatch", blame="local", published=entry.summary)
        else:
            header = {"arrays": entry.describe(), "chunk_bytes": self._chunk_bytes}
            plan = wire.chunk_plan(entry.sizes, self._chunk_bytes)
            if self._send(identity, [wire.HEAD, wire.pack(header)]):
                self._streams[identity] = _Stream(uuid, entry, plan, request.window, expires)

    def _pump(self) -> None:
        """Send every chunk that credits allow and that is final (progressive entries fill while they stream)."""
        for identity, stream in list(self._streams.items()):
            while stream.credits > 0 and stream.next_chunk < len(stream.plan):
                index, offset, length = stream.plan[stream.next_chunk]
                if offset + length > stream.entry.final_bytes(index):
                    break  # the producer's "filled" notice wakes us
                chunk = stream.entry.host_bytes(index)[offset : offset + length]
                if not self._send(identity, [wire.DATA, chunk]):
                    break
                stream.next_chunk += 1
                stream.credits -= 1
            if stream.next_chunk == len(stream.plan) and identity in self._streams:
                del self._streams[identity]
                if self._send(identity, [wire.DONE]):
                    self._delivered.add(stream.uuid)

    def _expire(self, now: float) -> None:
        for identity, stream in list(self._streams.items()):
            if now > stream.expires:  # the puller gave up; free the stream (the hold itself lives on)
                del self._streams[identity]
        for uuid, waiting in list(self._parked.items()):
            for identity, (_, expires) in list(waiting.items()):
                if now > expires:
                    del waiting[identity]
            if not waiting:
                del self._parked[uuid]

    def _fail(self, identity: bytes, reason: str, *, blame: str = "remote", published: str = "") -> None:
        self._streams.pop(identity, None)
        self._send(identity, [wire.FAIL, wire.pack({"reason": reason, "blame": blame, "published": published})])

    def _send(self, identity: bytes, frames: list) -> bool:
        try:
            self._sock.send_multipart([identity, *frames], copy=False)
            return True
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the puller is gone
            log.debug("dropping stream to a vanished puller: %s", exc)
            self._streams.pop(identity, None)
            return False
