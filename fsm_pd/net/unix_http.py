"""httpx clients that reach servers on unix sockets (``unix:PATH`` URLs) as well as over TCP, in one client.

httpx takes one unix socket per transport (``HTTPTransport(uds=PATH)``) and reads ``unix:PATH`` as a relative URL, so a
``unix:PATH`` base URL is written ``http+unix://localhost/PATH`` here (``http_url``), to which paths are appended as
to any base URL (``.../prefill-0.sock/generate``). The transport mounted for that scheme (``client``,
``async_client``) finds the socket along the URL's path, the first component that is a socket file (a socket is never
a directory, so there is one; looked for on the disk once per socket, then known by its path), and sends the rest
(``/generate?...``) as an ``http://localhost`` request through that socket's own transport. A path with no socket
along it is a ``ConnectError``, as a port nobody listens on is.
"""

from __future__ import annotations

import os
import stat
import threading
from typing import Any
from urllib.parse import quote

import httpx

from fsm_pd.net.asgi_transport import InProcessASGITransport
from fsm_pd.net.unix_sockets import is_unix, unix_path

__all__ = ["SCHEME", "AsyncUnixTransport", "UnixTransport", "async_client", "client", "http_url", "split_socket"]

SCHEME = "http+unix"


def http_url(url: str) -> str:
    """The base URL a client of this module takes for ``url``: ``unix:PATH`` becomes ``http+unix://localhost/PATH``;
    any other URL is returned as it is."""
    return f"{SCHEME}://localhost{quote(unix_path(url))}" if is_unix(url) else url


def split_socket(path: str) -> tuple[str, str]:
    """``(socket, rest)`` of a URL path that runs through a socket file: ``/run/p.sock/health`` ->
    ``("/run/p.sock", "/health")``. ``FileNotFoundError`` when no component of it is a socket."""
    parts = path.split("/")
    for end in range(2, len(parts) + 1):
        candidate = "/".join(parts[:end])
        try:
            mode = os.stat(candidate).st_mode
        except OSError:  # missing, or a component that is a file: nothing further along exists
            break
        if stat.S_ISSOCK(mode):
            return candidate, "/" + "/".join(parts[end:])
    raise FileNotFoundError(f"no unix socket along {path}")


class _Sockets:
    """A transport per socket, made on first use; what both transports below share. A request to a socket reached
    before finds it among them, by its path alone: ``split_socket`` stats the path's components, a system call each,
    and an async client routes on the event loop, where a router sends every request and health check."""

    def __init__(self, make):
        self._make, self._lock = make, threading.Lock()
        self.by_path: dict[str, Any] = {}

    def _known(self, url_path: str) -> tuple[str, str] | None:
        """Under the lock: ``(socket, rest)`` when ``url_path`` runs through a socket reached before. (One that
        has gone since fails as it would have: its transport cannot connect, a ``ConnectError``.)"""
        for path in self.by_path:
            if url_path == path:
                return path, "/"
            if url_path.startswith(path) and url_path[len(path)] == "/":
                return path, url_path[len(path):]
        return None

    def route(self, request: httpx.Request) -> tuple[Any, httpx.Request]:
        with self._lock:
            known = self._known(request.url.path)
        try:
            path, rest = known or split_socket(request.url.path)
        except FileNotFoundError as exc:
            raise httpx.ConnectError(str(exc), request=request) from None
        with self._lock:
            transport = self.by_path.get(path)
            if transport is None:
                transport = self.by_path[path] = self._make(path)
        url = httpx.URL(scheme="http", host="localhost", path=rest, query=request.url.query)
        forwarded = httpx.Request(request.method, url, headers=request.headers, stream=request.stream,
                                  extensions=request.extensions)
        return transport, forwarded

    def take_all(self) -> list:
        with self._lock:
            transports, self.by_path = list(self.by_path.values()), {}
        return transports


class UnixTransport(httpx.BaseTransport):
    """``http+unix://localhost/SOCKET/PATH`` requests, each through its socket's ``HTTPTransport``; ``options`` go
    to every one of them (``limits``, ``retries``)."""

    def __init__(self, **options: Any):
        self._sockets = _Sockets(lambda path: httpx.HTTPTransport(uds=path, **options))

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        transport, forwarded = self._sockets.route(request)
        return transport.handle_request(forwarded)

    def close(self) -> None:
        for transport in self._sockets.take_all():
            transport.close()


class AsyncUnixTransport(httpx.AsyncBaseTransport):
    """``UnixTransport`` for an ``AsyncClient``. ``local_apps``: {socket path: the ASGI app of this process that
    serves it}: requests to those sockets call the app directly (``asgi_transport.py``), not through the socket."""

    def __init__(self, local_apps: dict[str, Any] | None = None, **options: Any):
        apps = dict(local_apps or {})
        self._sockets = _Sockets(lambda path: InProcessASGITransport(apps[path]) if path in apps
                                 else httpx.AsyncHTTPTransport(uds=path, **options))

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        transport, forwarded = self._sockets.route(request)
        return await transport.handle_async_request(forwarded)

    async def aclose(self) -> None:
        for transport in self._sockets.take_all():
            await transport.aclose()


def _transport_options(options: dict) -> dict:
    # ``verify`` too: a client given an SSL context of its own (``verify=ctx``) makes none per socket, each of which
    # loads the CA bundle (about 6 ms of CPU); a bench with a client a stream made 64 of them as its run began
    return {name: options[name] for name in ("limits", "verify") if name in options}


def client(**options: Any) -> httpx.Client:
    """``httpx.Client(**options)`` that also reaches ``http_url``'s unix socket URLs."""
    return httpx.Client(mounts={f"{SCHEME}://": UnixTransport(**_transport_options(options))}, **options)


def async_client(local_apps: dict[str, Any] | None = None, **options: Any) -> httpx.AsyncClient:
    """``httpx.AsyncClient(**options)`` that also reaches ``http_url``'s unix socket URLs (those of ``local_apps``
    by calling their app in this process: ``AsyncUnixTransport``)."""
    transport = AsyncUnixTransport(local_apps, **_transport_options(options))
    return httpx.AsyncClient(mounts={f"{SCHEME}://": transport}, **options)


def request(method: str, url: str, **options: Any) -> httpx.Response:
    """One request, as ``httpx.request`` makes it, to ``url`` (``unix:PATH/...`` not taken: give ``http_url``'s
    form); ``timeout`` goes to the client, the rest to the request."""
    with client(timeout=options.pop("timeout", 5.0)) as one:
        return one.request(method, url, **options)
