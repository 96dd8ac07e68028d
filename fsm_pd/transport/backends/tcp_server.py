"""P side of the tcp backend: accept pull connections and stream each one from its own thread. The connections are
TCP, or unix stream sockets when the server listens on one (``uds``): the stream is the same.

A stream thread never holds the table lock while it sends. It waits (on the backend's condition, which shares the
hold table's lock) for the entry to be published or for more of a progressive entry to become final, then sends
with a socket timeout at the puller's own deadline, so a vanished or stalled D ends the thread, never the server.
A hold that ends mid-stream turns the next frame into a FAIL with the reason.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import select
import socket
import threading
import time
from collections.abc import Callable

from fsm_pd.net.unix_sockets import Listener
from fsm_pd.transport.addresses import bare_host, is_ipv6, with_port
from fsm_pd.transport.backends import tcp_wire as wire
from fsm_pd.transport.backends.holds import PullWaits
from fsm_pd.transport.backends.host_stream import HostEntry

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 10.0  # a connection must say what it wants within this
# P waits this much past the puller's deadline before it hangs up, so that D's own timer fires first and reports a
# timeout (not a producer that went away): both clocks start the same timeout, D's a little earlier.
GRACE_S = 1.0
MAX_TIMEOUT_S = 3600.0  # a pull that asks to be served for longer is a bad request
COALESCE_BYTES = 256 << 10  # data frames up to this size are joined with their neighbours into one send


class _Ended(Exception):
    """The entry a stream serves ended (released, failed, expired or closed), or its puller's deadline passed."""


class _Mismatch(Exception):
    """The puller's spec digest is not the published layout's (the argument: a summary of what was published)."""


class TcpPullServer:
    def __init__(
        self,
        lookup: Callable[[int], tuple[HostEntry | None, str | None]],
        changed: threading.Condition,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        uds: str | None = None,
        frame_bytes: int = 4 << 20,
        max_streams: int = 256,
    ) -> None:
        """``lookup(uuid)`` (called under ``changed``'s lock) returns ``(entry, None)`` for a live hold,
        ``(None, reason)`` for an ended one, else ``(None, None)``; ``changed`` is notified on every publish, end
        and progress. At most ``max_streams`` connections are served at once (a thread each); more are refused
        with a FAIL, so a flood of connections costs no more than that many threads. ``uds``: listen on that unix
        socket instead of ``host:port`` (the address is then ``unix:PATH``; the file goes when the server stops)."""
        self._lookup, self._changed, self._frame_bytes = lookup, changed, frame_bytes
        self._max_streams = max_streams
        self._slots = threading.BoundedSemaphore(max_streams)
        # Long-lived daemon stream threads: starting a thread per pull is a handshake between two threads, and on a
        # node whose other threads keep the GIL busy every handoff costs milliseconds. Daemons, so that a stream
        # stuck until its deadline never holds up the process's exit.
        self._work: queue.SimpleQueue[socket.socket | None] = queue.SimpleQueue()
        self._workers_lock = threading.Lock()
        self._workers = 0
        self._idle = 0
        self._pulls = PullWaits(changed)  # streams parked until their uuid's publish, entries delivered once
        self._unix: Listener | None = None
        if uds is not None:
            self._unix = Listener(uds, what="the tcp transfer backend")
            self._listener, self.address = self._unix.socket, self._unix.address
        else:
            family = socket.AF_INET6 if is_ipv6(host) else socket.AF_INET
            self._listener = socket.create_server((bare_host(host), port), family=family)
            bound_host, bound_port = self._listener.getsockname()[:2]
            self.address = f"tcp://{with_port(bound_host, bound_port)}"  # IPv6 in brackets
        self._stopping = False
        self._thread = threading.Thread(target=self._accept, name=f"fsm-pd-tcp-server {self.address}", daemon=True)
        self._thread.start()

    def parked(self) -> frozenset[int]:
        return self._pulls.parked()

    def ended(self, uuid: int) -> None:
        """Called under ``changed``'s lock when a hold ends: a new publish would be a new delivery."""
        self._pulls.ended(uuid)

    def stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        if self._unix is not None:
            self._unix.close()  # the socket and its file
        else:
            self._listener.close()
        self._thread.join(timeout=5)
        with self._changed:
            self._changed.notify_all()  # parked streams see _stopping; streams of ended holds send their FAIL
        with self._workers_lock:
            workers = self._workers
        for _ in range(workers):  # each worker exits when it reaches one (after the stream it is serving, if any)
            self._work.put(None)

    def _accept(self) -> None:
        while not self._stopping:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                if self._stopping:
                    return
                log.exception("tcp pull server %s: accept failed", self.address)
                time.sleep(0.1)
                continue
            if not self._slots.acquire(blocking=False):
                with conn:  # a fresh connection's send buffer is empty: this FAIL cannot block
                    self._fail(conn, f"producer busy: all {self._max_streams} pull streams in use", "remote")
                continue
            self._dispatch(conn)

    def _dispatch(self, conn: socket.socket) -> None:
        with self._workers_lock:
            grow = self._idle == 0
            if grow:
                self._workers += 1
            else:
                self._idle -= 1
        self._work.put(conn)
        if grow:
            threading.Thread(target=self._worker, name="fsm-pd-tcp-stream", daemon=True).start()

    def _worker(self) -> None:
        while (conn := self._work.get()) is not None:
            self._serve(conn)
            with self._workers_lock:
                self._idle += 1

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._serve_one(conn)
        except Exception:  # a bug here must not cost the worker thread
            log.exception("tcp pull server %s: a stream failed", self.address)
        finally:
            self._slots.release()

    def _serve_one(self, conn: socket.socket) -> None:
        with conn:
            if conn.family != socket.AF_UNIX:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(REQUEST_TIMEOUT_S)
            try:
                request = wire.read_request(conn)
                if request.get("v") != wire.PROTOCOL_VERSION:
                    self._fail(conn, f"protocol version {request.get('v')} != {wire.PROTOCOL_VERSION}", "local")
                    return
                uuid, digest = int(request["uuid"]), bytes(request["digest"])
                timeout_s = float(request.get("timeout_s", 60.0))
                if not 0 < timeout_s <= MAX_TIMEOUT_S:  # also refuses NaN
                    self._fail(conn, f"timeout_s must be in (0, {MAX_TIMEOUT_S:g}], got {timeout_s!r}", "local")
                    return
                deadline = time.monotonic() + timeout_s + GRACE_S
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.debug("tcp pull server %s: dropping a bad request: %s", self.address, exc)
                return
            try:
                self._stream(conn, uuid, digest, deadline)
            except _Ended as exc:
                self._fail(conn, str(exc), "remote")
            except _Mismatch as exc:
                self._fail(conn, "spec mismatch", "local", published=str(exc))
            except OSError as exc:  # the puller went away or stopped reading; its own deadline handles it
                log.debug("tcp pull server %s: stream of %s ended: %s", self.address, uuid, exc)

    def _stream(self, conn: socket.socket, uuid: int, digest: bytes, deadline: float) -> None:
        """HEAD, DATA frames as bytes become final, END. Small pieces are joined into one send: on a busy node
        every socket call is a GIL round trip (milliseconds each under contention), so a small transfer goes out
        as one write instead of four."""
        entry = self._claim(uuid, digest, deadline)
        if entry is None:
            return
        head = wire.pack({"arrays": entry.describe()})
        if entry.pages is not None:
            self._send(conn, deadline, wire.frame_header(wire.HEAD, len(head)) + head)
            self._stream_pages(conn, uuid, entry, deadline)
            self._send(conn, deadline, wire.frame_header(wire.END, 0))
            return
        pending = [wire.frame_header(wire.HEAD, len(head)), head]

        def flush() -> None:
            if pending:
                self._send(conn, deadline, b"".join(pending))
                pending.clear()

        for index, size in enumerate(entry.sizes):
            sent = 0
            while sent < size:
                if entry.final_bytes(index) <= sent:
                    flush()  # before waiting for the producer: what is final goes out now
                final = self._wait_final(uuid, entry, index, sent, deadline)
                end = min(final, sent + self._frame_bytes)
                pending.append(wire.frame_header(wire.DATA, end - sent))
                data = entry.host_bytes(index)[sent:end]
                if len(data) <= COALESCE_BYTES:
                    pending.append(data)
                else:
                    flush()
                    self._send(conn, deadline, data)
                sent = end
        pending.append(wire.frame_header(wire.END, 0))
        flush()

    def _stream_pages(self, conn: socket.socket, uuid: int, entry: HostEntry, deadline: float) -> None:
        """DATA frames read straight from the pool's pages (``kernels/page_source.py``). Every write is a
        non-blocking ``sendmsg`` made while the model thread runs no job; waiting for room in the socket happens
        outside that, so a slow puller never holds a step back. A hold that ends mid-frame gets the frame's rest as
        zeros (its pages may be another request's by then), and then the FAIL."""
        reader = entry.pages.reader()
        check = lambda: self._check_live(uuid, entry)  # noqa: E731
        conn.setblocking(True)  # MSG_DONTWAIT per write; a socket timeout would poll inside the lease
        poller = select.poll()
        poller.register(conn, select.POLLOUT)
        total, pos = entry.sizes[0], 0
        while pos < total:
            end = min(total, pos + self._frame_bytes)
            header, header_sent = wire.frame_header(wire.DATA, end - pos), 0
            try:
                while pos < end:
                    sent = reader.send(conn, memoryview(header)[header_sent:], pos, end, check)
                    took = min(sent, len(header) - header_sent)
                    header_sent, pos = header_sent + took, pos + sent - took
                    if pos < end:
                        _wait_writable(poller, deadline)
            except _Ended:
                if header_sent:
                    self._send(conn, deadline, header[header_sent:] + bytes(end - pos))
                raise

    def _check_live(self, uuid: int, entry: HostEntry) -> None:
        with self._changed:
            current, ended = self._lookup(uuid)
            if current is not entry:
                raise _Ended(f"transfer {uuid} {ended or 'ended'}")

    def _claim(self, uuid: int, digest: bytes, deadline: float) -> HostEntry | None:
        """Wait until ``uuid`` is published, then take its one delivery (None: not published by the deadline)."""
        with self._changed:
            entry = self._pulls.wait(uuid, deadline, lambda: self._published(uuid), lambda: self._stopping)
            if entry is None:
                return None  # nobody published it in time; the puller times out on its own
            if self._pulls.delivered(uuid):
                raise _Ended(f"transfer {uuid} was already pulled and awaits release")
            if digest != entry.digest:
                raise _Mismatch(entry.summary)
            self._pulls.deliver(uuid)
            return entry

    def _published(self, uuid: int) -> HostEntry | None:
        """Under ``changed``: ``uuid``'s entry once published; raises ``_Ended`` once it ended."""
        entry, ended = self._lookup(uuid)
        if ended is not None:
            raise _Ended(f"transfer {uuid} {ended}")
        return entry

    def _wait_final(self, uuid: int, entry: HostEntry, index: int, sent: int, deadline: float) -> int:
        """Bytes of array ``index`` that may be sent, once more than ``sent`` are final; raises if the hold ends."""
        with self._changed:
            while True:
                current, ended = self._lookup(uuid)
                if current is not entry:
                    raise _Ended(f"transfer {uuid} {ended or 'ended'}")
                final = entry.final_bytes(index)
                if final > sent:
                    return final
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise _Ended(f"transfer {uuid}: the producer did not finish filling it before the deadline")
                self._changed.wait(remaining)

    @staticmethod
    def _send(conn: socket.socket, deadline: float, data: bytes | memoryview) -> None:
        conn.settimeout(max(deadline - time.monotonic(), 0.001))
        conn.sendall(data)

    @staticmethod
    def _fail(conn: socket.socket, reason: str, blame: str, published: str = "") -> None:
        with contextlib.suppress(OSError):
            conn.settimeout(1.0)
            wire.send_message(conn, wire.FAIL, {"reason": reason, "blame": blame, "published": published})


def _wait_writable(poller: select.poll, deadline: float) -> None:
    while not poller.poll(max(1, int((deadline - time.monotonic()) * 1000))):
        if time.monotonic() >= deadline:
            raise TimeoutError("the puller stopped reading")
