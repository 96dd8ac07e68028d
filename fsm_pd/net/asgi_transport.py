"""An httpx transport that calls an ASGI app of the same process directly, streaming its answer as it is sent.

``--role pd`` runs its router and both engines' HTTP apps in one process. Over their unix sockets every token crossed
h11 twice, a socket and two event loops on two threads, all under one interpreter lock beside the model thread. With
this transport the router's requests run the engine's app on the router's own event loop: the same app, the same
routes and checks, no socket and no second loop. httpx's own ``ASGITransport`` reads the whole answer before it
returns, which a stream of tokens cannot wait for; this one hands each body chunk on as the app sends it.

A client that closes the answer early (the router's leg ends) is a disconnect to the app, as a closed socket is.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx

_END = object()


class _Body(httpx.AsyncByteStream):
    def __init__(self, chunks: asyncio.Queue, task: asyncio.Task, gone: asyncio.Event) -> None:
        self._chunks, self._task, self._gone = chunks, task, gone

    async def __aiter__(self):
        while (chunk := await self._chunks.get()) is not _END:
            if isinstance(chunk, BaseException):
                raise httpx.ReadError(f"the in-process app failed mid-answer: {chunk}") from chunk
            yield chunk

    async def aclose(self) -> None:
        self._gone.set()  # the app's next receive() says http.disconnect, as a closed socket would
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
        chunks: asyncio.Queue = asyncio.Queue()
        started: asyncio.Future = asyncio.get_running_loop().create_future()
        gone, sent_body = asyncio.Event(), False

        async def receive() -> dict:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                if not started.done():
                    started.set_result(message)
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    chunks.put_nowait(bytes(message["body"]))
                if not message.get("more_body", False):
                    chunks.put_nowait(_END)

        async def run() -> None:
            try:
                await self.app(scope, receive, send)
            except BaseException as exc:
                if not started.done():
                    started.set_exception(exc)
                else:
                    chunks.put_nowait(exc)
                raise
            finally:
                chunks.put_nowait(_END)  # an app that returned without ending its body ends it here
                if not started.done():
                    started.set_exception(httpx.RemoteProtocolError("the in-process app sent no answer"))

        task = asyncio.ensure_future(run())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: raised to the reader instead
        try:
            head = await started
        except BaseException as exc:
            raise httpx.ConnectError(f"the in-process app failed: {exc}", request=request) from exc
        return httpx.Response(head["status"], headers=head.get("headers", []), stream=_Body(chunks, task, gone),
                              request=request)
