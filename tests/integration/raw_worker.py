"""A raw HTTP worker on 127.0.0.1 for the router's failure and deadline tests: healthy by its ``/health`` (a 200),
it answers every other request with a scripted ``reply`` (headers and the start of a body, or nothing) and then
closes the connection or holds it open: what a broken or stalled worker looks like from the router, byte for byte.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from dataclasses import dataclass, field

# "connection: close", as the worker then closes it: without it the router's client may keep the connection and send
# the next request down it as the close arrives (a 502 under load, seen once in a full run with two workers)
HEALTHY = (b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 16\r\nconnection: close\r\n\r\n'
           b'{"status": "ok"}')


@dataclass
class RawWorker:
    """What the router did to the worker (fields for tests)."""

    url: str = ""
    requests: list[bytes] = field(default_factory=list)  # the request lines of the scripted requests
    requests_bodies: list[bytes] = field(default_factory=list)  # and their bodies
    requests_heads: list[bytes] = field(default_factory=list)  # and their whole heads (the request line, headers)
    hung_up: threading.Event = field(default_factory=threading.Event)  # the router closed a held connection


def read_request(conn: socket.socket) -> bytes | None:
    """One request (head and ``content-length`` body); None if the client closed first."""
    data = b""
    while b"\r\n\r\n" not in data:
        more = conn.recv(65536)
        if not more:
            return None
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        body += conn.recv(65536)
    return head + b"\r\n\r\n" + body[:length]


@contextlib.contextmanager
def raw_worker(reply: bytes, *, then_close: bool = False, hold_s: float | None = None, stopped_when_held: bool = False):
    """Yields a ``RawWorker``. After ``reply`` it closes the connection (``then_close``) or holds it open until the
    client goes away (or ``hold_s`` of silence). Each connection is served on its own thread, so ``/health`` keeps
    answering 200 while a request is held; ``stopped_when_held`` serves one connection at a time instead, so a held
    request silences ``/health`` too (a stopped node, which answered 200 before)."""
    server = socket.create_server(("127.0.0.1", 0))
    worker = RawWorker(f"http://127.0.0.1:{server.getsockname()[1]}")
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.settimeout(hold_s)
            request = read_request(conn)
            if request is None:
                return
            if request.startswith(b"GET /health "):
                conn.sendall(HEALTHY)  # connection: close
                return
            head, _, body = request.partition(b"\r\n\r\n")
            worker.requests.append(head.split(b"\r\n", 1)[0])
            worker.requests_bodies.append(body)
            worker.requests_heads.append(head)
            conn.sendall(reply)
            if not then_close:
                while conn.recv(65536):
                    pass
                worker.hung_up.set()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            if stopped_when_held:
                serve(conn)
            else:
                threading.Thread(target=serve, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        stop.set()
        thread.join(5)
        server.close()
