"""Serving an ASGI app with uvicorn: in the foreground (``serve``, for the CLI) or on a background thread
(``AppServer``: the bootstrap server inside a prefill node, tests). 127.0.0.1 unless told otherwise; on a unix socket
instead of a port when given ``uds`` (``unix_sockets.Listener``: a stale socket file is replaced, a live one refused,
and the file is removed when the server stops).

Every server bounds how long a client may take to send a request's headers and body (``ReadTimeouts``; flags, else
``$FSM_PD_HEADER_TIMEOUT_S`` / ``$FSM_PD_BODY_TIMEOUT_S``, else 10 s and 30 s), so slow clients cannot hold
connections open.

A serving process logs one way (``log_to_stderr``): every line with its time, so that a router's events line up
with the nodes' journals, and uvicorn's lines through the same handler (no server here gives it a logging config of
its own); httpx's line per request it sends (a router's health checks: most of its log) only at ``debug``.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import uvicorn

from fsm_pd.net.http_protocol import ReadTimeouts
from fsm_pd.net.unix_sockets import Listener, unix_address

log = logging.getLogger(__name__)
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
CHATTY = ("httpx", "httpcore")  # a line per request a client sends, health checks included


def log_to_stderr(level: str) -> None:
    """How a serving process logs (see the module's doc): at ``level`` (``info``, ``debug``, ...)."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)
    if level.lower() != "debug":
        for name in CHATTY:
            logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger("uvicorn.error").addFilter(_as_uvicorn)


def _as_uvicorn(record: logging.LogRecord) -> bool:
    """uvicorn writes its every line, ``Started server process`` too, to a logger named ``uvicorn.error``: name
    it ``uvicorn``, so that only an error reads as one (``launch`` looks for the line that says why a child exited)."""
    record.name = "uvicorn"
    return True


def _uvicorn_config(app, log_level: str, read_timeouts: ReadTimeouts | None = None, **overrides) -> uvicorn.Config:
    # lifespan auto: the router's shutdown stops its health checks and closes its client (an app without lifespan
    # support just runs); timeout_keep_alive: routers keep pooled connections open; log_config None: uvicorn's lines
    # go through the process's own handler (log_to_stderr), with their time, instead of a format of uvicorn's.
    timeouts = read_timeouts if read_timeouts is not None else ReadTimeouts.from_env()
    options = {"access_log": False, "lifespan": "auto", "timeout_keep_alive": 60, "http": timeouts.protocol(),
               "log_config": None, **overrides}
    return uvicorn.Config(app, log_level=log_level, **options)


def serve(app, host: str = "127.0.0.1", port: int = 30000, *, log_level: str = "info",
          read_timeouts: ReadTimeouts | None = None, uds: str | None = None) -> None:
    """Serve ``app`` until SIGINT/SIGTERM, on ``host:port`` or the unix socket ``uds``. ``read_timeouts``: default
    ``ReadTimeouts.from_env()``."""
    run(uvicorn.Server(_uvicorn_config(app, log_level, read_timeouts)), host, port, uds)


def run(server: uvicorn.Server, host: str, port: int, uds: str | None = None) -> None:
    """Run ``server`` in the foreground on ``host:port``, or on the unix socket ``uds`` (bound here, removed when
    the server stops)."""
    if uds is None:
        server.config.host, server.config.port = host, port
        server.run()
        return
    with Listener(uds, what="the HTTP server") as listener:
        log.info("serving HTTP on unix socket %s", listener.path)
        server.run(sockets=[listener.socket])


class AppServer:
    """``app`` served on a daemon thread. Port 0 picks a free port; ``url`` says which. With ``uds``, on that unix
    socket instead (``url`` is ``unix:PATH``)."""

    name = "server"

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning",
                 read_timeouts: ReadTimeouts | None = None, uds: str | None = None, **uvicorn_options):
        self.app, self.host, self._requested_port, self.log_level = app, host, port, log_level
        self.uds = uds
        self._listener: Listener | None = None
        self.read_timeouts = read_timeouts
        self._uvicorn_options = uvicorn_options
        self._port: int | None = None
        self._socket: socket.socket | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port (0 on a unix socket); it stays readable after ``stop()`` (a test may restart a server on
        it)."""
        if self._port is None:
            raise RuntimeError(f"the {self.name} is not started")
        return self._port

    @property
    def url(self) -> str:
        if self.uds is not None:
            return unix_address(self.uds)
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> AppServer:
        if self._thread is not None:
            raise RuntimeError(f"the {self.name} is already started")
        if self.uds is not None:
            self._listener = Listener(self.uds, what=f"the {self.name}")
            sock, self._port = self._listener.socket, 0
        else:
            sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((self.host, self._requested_port))
            except OSError:
                sock.close()
                raise
            self._port = sock.getsockname()[1]
        self._socket = sock
        self._server = uvicorn.Server(_uvicorn_config(self.app, self.log_level, self.read_timeouts,
                                                      **self._uvicorn_options))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name=f"{self.name}:{self.uds or self._port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the {self.name} on {self.uds or self.host} did not start within {timeout_s}s")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive() and self._server is not None:
                self._server.force_exit = True  # open streams or keep-alive connections held the graceful exit up
                self._thread.join(timeout_s)
        if self._listener is not None:
            self._listener.close()  # the socket, and its file
        elif self._socket is not None:
            self._socket.close()
        self._server = self._thread = self._socket = self._listener = None

    def __enter__(self) -> AppServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
