"""A decode stream of an engine in this process, passed through to the client as the engine's app sends it.

``--role pd`` calls its engines' apps in-process (``net/asgi_transport.py``) and relays their streams as bytes (no
migration: one decode engine). Relayed through ``legs.relay``, every chunk went from the engine's app through a
queue, httpx's body iterator, ``until`` (a timeout context a chunk), ``relay``, and the router's own
``StreamingResponse`` with its task group: about a tenth of the interpreter's time under 16 streams (py-spy
``--gil``, CPU, tiny model). Here the engine's app ``send`` awaits the client's ``send`` itself (the transport's
``PASS_TO``), and the router's task only watches the stream, once per stream rather than once per chunk:

- the stream's end: the body ended (it must have ended with ``[DONE]``), or broke off (the app failed);
- the request's deadline and the idle deadline between chunks, from the stream's start or the end of the client's
  last ``send`` (time the client takes to read is not the engine's silence, as with ``relay``);
- its worker lost (the health checks' event), and the client leaving (its ``http.disconnect``).

Whatever ends a stream early ends it as ``relay`` does: ``[DONE]`` after an answer whose finish went out, else an
error event and ``[DONE]`` (``legs.stream_end``), counted as ``relay`` counts it; then the leg is closed (the app
sees a disconnect; the decode's slot and running entry are released). Nothing the engine still sends after that
reaches the client. Errors and retries before the answer starts are the attempt's, as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from fastapi.responses import Response

from fsm_pd.api.tasks import cancel_and_wait
from fsm_pd.router.legs import (
    broke_off_message,
    deadline_message,
    ends_with_done,
    idle_message,
    lost_message,
    no_done_message,
    stream_end,
)
from fsm_pd.router.migrate import FinishWatch

Sink = Callable[[bytes], Awaitable[None]]
_LEFT = object()  # the client went away: nothing more is sent


class _Client:
    """The client's side of one stream: the sink the engine's app sends through, what went out, and when the wait
    for the next chunk began."""

    def __init__(self, send: Callable, loop: asyncio.AbstractEventLoop) -> None:
        self.send, self.loop = send, loop
        self.tail, self.finish = b"", FinishWatch()
        self.asked = loop.time()  # the idle clock's start: the stream's, then each send's end
        self.sending = False
        self.stopped = False  # the stream was ended here: what the app still sends goes nowhere
        self.failed: asyncio.Future = loop.create_future()  # the client's send raised
        self._sent: asyncio.Future | None = None

    async def sink(self, chunk: bytes) -> None:
        if self.stopped:
            return
        self.tail = (self.tail + chunk)[-32:]
        self.finish.feed(chunk)
        self.sending = True
        try:
            await self.send({"type": "http.response.body", "body": chunk, "more_body": True})
        except Exception as exc:  # the app sees its stream end by a disconnect, not by the client's error
            self.stopped = True
            if not self.failed.done():
                self.failed.set_result(exc)
        finally:
            self.sending = False
            self.asked = self.loop.time()
            if self._sent is not None:
                self._sent.set_result(None)
                self._sent = None

    def sent(self) -> asyncio.Future:
        """Done once the chunk being sent has gone (called only while ``sending``)."""
        if self._sent is None:
            self._sent = self.loop.create_future()
        return self._sent


class PassThrough(Response):
    """The client's answer: the decode leg's stream, handed to the client's ``send`` by the engine's app (module
    doc). ``close()`` ends the attempt once the stream has ended, whichever way."""

    def __init__(self, pass_to: Callable[[Sink], Awaitable[Exception | None]], *, status_code: int,
                 media_type: str, headers: dict, worker_url: str, deadline: float, timeout_s: float,
                 lost: asyncio.Event | None, idle_s: float | None, expired: Callable[[str], None],
                 close: Callable[[], Awaitable[None]]) -> None:
        self.status_code, self.media_type, self.background = status_code, media_type, None
        self.init_headers(headers)
        self._pass_to, self._close = pass_to, close
        self.worker_url, self.deadline, self.timeout_s, self.idle_s = worker_url, deadline, timeout_s, idle_s
        self._lost, self._expired = lost, expired

    async def __call__(self, scope, receive, send) -> None:
        client = _Client(send, asyncio.get_running_loop())
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            ending = await self._watched(client, receive)
            if client.failed.done():
                raise client.failed.result()
            if ending is not _LEFT:
                await send({"type": "http.response.body", "body": ending, "more_body": False})
        finally:
            await self._close()  # the app sees a disconnect if it has not ended; the decode's slot is released
        if self.background is not None:  # FastAPI's background tasks run after the answer, as for any response
            await self.background()

    async def _watched(self, client: _Client, receive) -> object:
        """Run the stream until it ends; what to send last (b"" after a whole stream), or ``_LEFT``."""
        pumping = asyncio.ensure_future(self._pass_to(client.sink))
        left = asyncio.ensure_future(_disconnect(receive))
        lost = asyncio.ensure_future(self._lost.wait()) if self._lost is not None else None
        try:
            return await self._watch(client, pumping, left, lost)
        finally:
            client.stopped = True
            await cancel_and_wait(*(t for t in (pumping, left, lost) if t is not None and not t.done()),
                                  what=f"the stream from {self.worker_url}")

    async def _watch(self, client: _Client, pumping: asyncio.Future, left: asyncio.Future,
                     lost: asyncio.Future | None) -> object:
        loop = asyncio.get_running_loop()
        waits = {pumping, left, client.failed} | ({lost} if lost is not None else set())
        problem: tuple[int, str] | None = None
        worker_lost = False
        while True:
            due = self.deadline if self.idle_s is None else min(self.deadline, client.asked + self.idle_s)
            if client.sending:  # the client's time: whatever is due waits for the chunk in flight to go
                done, _ = await asyncio.wait(waits | {client.sent()}, return_when=asyncio.FIRST_COMPLETED)
            else:
                done, _ = await asyncio.wait(waits, timeout=max(0.0, due - loop.time()),
                                             return_when=asyncio.FIRST_COMPLETED)
            if left in done or client.failed in done:
                return _LEFT
            if pumping in done:
                if (error := pumping.result()) is not None:
                    problem = 502, broke_off_message(self.worker_url, error)
                elif ends_with_done(client.tail):
                    return b""
                else:
                    problem = 502, no_done_message(self.worker_url)
                return stream_end(problem, client.finish, self.worker_url)
            if lost in done:
                waits.discard(lost)  # noted: a future that is done would end every wait at once
                worker_lost = True
            if client.sending:
                continue
            if worker_lost:
                return stream_end((502, lost_message(self.worker_url)), client.finish, self.worker_url)
            due = self.deadline if self.idle_s is None else min(self.deadline, client.asked + self.idle_s)
            if loop.time() < due:
                continue
            if due < self.deadline:
                self._expired("stream_idle")
                problem = 504, idle_message(self.worker_url, self.idle_s)
            else:
                self._expired("request")
                problem = 504, deadline_message(self.timeout_s)
            return stream_end(problem, client.finish, self.worker_url)


async def _disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
