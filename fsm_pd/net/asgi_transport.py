"""An httpx transport that calls an ASGI app of the same process directly, streaming its answer as it is sent.

``--role pd`` runs its router and both engines' HTTP apps in one process. Over their unix sockets every token crossed
h11 twice, a socket and two event loops on two threads, all under one interpreter lock beside the model thread. With
this transport the router's requests run the engine's app on the router's own event loop: the same app, the same
routes and checks, no socket and no second loop. httpx's own ``ASGITransport`` reads the whole answer before it
returns, which a stream of tokens cannot wait for; this one hands each body chunk on as the app sends it.

A reader that wants the chunks with no queue between, sent on by the app's own ``send`` (the router passing a
stream through to its client: ``router/passthrough.py``), takes the answer's ``extensions[PASS_TO]``.

A client that closes the answer early (the router's leg ends) is a disconnect to the app, as a closed socket is.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

_END = object()
# the answer's extension that hands its body to a sink instead of a reader (``_Body.pass_to``)
PASS_TO = "fsm_pd.pass_to"


class _Pipe:
    """One request's ASGI channel: the body going in, the answer coming out, queued for the reader or handed to a
    sink once one is set."""

    def __init__(self, body: bytes) -> None:
        self.body, self.sent_body = body, False
        self.chunks: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self.started: asyncio.Future = loop.create_future()
        self.ended: asyncio.Future = loop.create_future()  # None: the body ended; else what broke it
        self.gone = asyncio.Event()
        self.sink: Callable[[bytes], Awaitable[None]] | None = None

    async def receive(self) -> dict:
        if not self.sent_body:
            self.sent_body = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.body":
            if chunk := message.get("body"):
                if self.sink is not None:
                    await self.sink(bytes(chunk))
                else:
                    self.chunks.put_nowait(bytes(chunk))
            if not message.get("more_body", False):
                self.end(None)
        elif message["type"] == "http.response.start" and not self.started.done():
            self.started.set_result(message)

    def end(self, error: BaseException | None) -> None:
        if not self.ended.done():
            self.ended.set_result(error)
        self.chunks.put_nowait(_END if error is None else error)


def _broken(error: BaseException) -> httpx.ReadError:
    failed = httpx.ReadError(f"the in-process app failed mid-answer: {error}")
    failed.__cause__ = error
    return failed


class _Body(httpx.AsyncByteStream):
    def __init__(self, pipe: _Pipe, task: asyncio.Task) -> None:
        self._pipe, self._task = pipe, task

    async def __aiter__(self):
        while (chunk := await self._pipe.chunks.get()) is not _END:
            if isinstance(chunk, BaseException):
                raise _broken(chunk)
            yield chunk

    async def pass_to(self, sink: Callable[[bytes], Awaitable[None]]) -> httpx.ReadError | None:
        """Hand the rest of the answer to ``sink``, awaited by the app's own ``send`` for each chunk (no queue and
        no reader task between: the app waits while the sink sends). Returns once the answer ended: None when its
        body ended, else the ``ReadError`` a reader would have got. The chunks queued before go first."""
        pipe = self._pipe
        while not pipe.chunks.empty():
            chunk = pipe.chunks.get_nowait()
            if chunk is _END:
                return None
            if isinstance(chunk, BaseException):
                return _broken(chunk)
            await sink(chunk)
        pipe.sink = sink  # set with the queue empty: no chunk can come between the queued ones and the sink's
        error = await asyncio.shield(pipe.ended)
        return None if error is None else _broken(error)

    async def aclose(self) -> None:
        self._pipe.gone.set()  # the app's next receive() says http.disconnect, as a closed socket would
        if not self._task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self._task), 5.0)
        if not self._task.done():
            self._task.cancel()


class InProcessASGITransport(httpx.AsyncBaseTransport):
    """Requests to ``app`` (an ASGI 3 app of this process), answered as it streams."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": request.method, "scheme": "http", "path": request.url.path,
                 "raw_path": request.url.raw_path.split(b"?", 1)[0], "query_string": request.url.query,
                 "root_path": "", "headers": [(k.lower(), v) for k, v in request.headers.raw],
                 "client": ("127.0.0.1", 0), "server": ("localhost", 80), "state": {}}
        pipe = _Pipe(body)

        async def run() -> None:
            try:
                await self.app(scope, pipe.receive, pipe.send)
            except BaseException as exc:
                if not pipe.started.done():
                    pipe.started.set_exception(exc)
                else:
                    pipe.end(exc)
                raise
            finally:
                pipe.end(None)  # an app that returned without ending its body ends it here
                if not pipe.started.done():
                    pipe.started.set_exception(httpx.RemoteProtocolError("the in-process app sent no answer"))

        task = asyncio.ensure_future(run())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: raised to the reader instead
        try:
            head = await pipe.started
        except BaseException as exc:
            raise httpx.ConnectError(f"the in-process app failed: {exc}", request=request) from exc
        stream = _Body(pipe, task)
        return httpx.Response(head["status"], headers=head.get("headers", []), stream=stream, request=request,
                              extensions={PASS_TO: stream.pass_to})
