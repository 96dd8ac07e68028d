"""Running one request on an engine from a request handler, and aborting it when its client goes away.

A client that disconnects must free what its request holds (KV pages, a decode slot, a bootstrap room), so every
wait on the engine is raced against the ASGI ``http.disconnect`` message. A request that finished is never aborted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from fastapi import Request

from fsm_pd.api.outputs import RequestState
from fsm_pd.api.tasks import cancel_and_wait
from fsm_pd.serving.types import Engine, EngineError, GenerateRequest, RequestStream, TokenOutput

log = logging.getLogger(__name__)


class ClientDisconnected(Exception):
    pass


def _abandon(task: asyncio.Future) -> None:
    """Cancel a task nobody will await; whatever it ends with (the abort's EngineError, a cancellation) is
    retrieved, so asyncio never logs "Task exception was never retrieved" for it."""
    task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


async def wait_disconnect(request: Request) -> None:
    # The body was read already (FastAPI parsed it), so the next message a server sends is the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class RequestRun:
    """One submitted request: its outputs, accumulated into ``state``; ``close()`` aborts it unless it finished."""

    def __init__(self, engine: Engine, request: GenerateRequest, tokenizer, http_request: Request | None,
                 live: dict[str, RequestRun] | None = None, *, hide_output: bool = False):
        self.engine = engine
        self._live = live if live is not None else {}
        self.state = RequestState(request, tokenizer, hide_output=hide_output)
        self._http = http_request
        self._stream = RequestStream(request.rid)
        self._outputs = aiter(self._stream)
        self._disconnect: asyncio.Task | None = None
        self._closed = False
        self._ended_by_engine = False
        engine.submit(request, self._stream)  # an EngineError here is the engine refusing the request outright
        self._live[request.identity] = self

    @property
    def http_request(self) -> Request | None:
        return self._http

    @property
    def rid(self) -> str:
        return self.state.request.rid

    @property
    def identity(self) -> tuple[str, int | None]:
        """rid and room (PD), the rid alone (colocated): whom ``close`` aborts (``GenerateRequest.identity``)."""
        return self.state.request.identity

    async def next_output(self) -> TokenOutput | None:
        """The next output (added to ``state``), None after the last. Raises EngineError, or ClientDisconnected."""
        try:
            return await self._next_output()
        except EngineError:
            # The engine ended the request and forgot it: on a colocated node an abort by its rid from now on could
            # only hit a later request with the same rid (on a PD node the abort names the room as well).
            self._ended_by_engine = True
            raise

    async def _next_output(self) -> TokenOutput | None:
        if self.state.finished:
            return None
        if self._http is None:  # an internal request (a health probe): nobody to go away
            return self._add(await anext(self._outputs, None))
        if self._disconnect is None:
            self._disconnect = asyncio.ensure_future(wait_disconnect(self._http))
        pending = asyncio.ensure_future(anext(self._outputs))
        try:
            done, _ = await asyncio.wait({pending, self._disconnect}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled (a stream whose client left): the read must not outlive us unheard
            _abandon(pending)
            raise
        if pending not in done:
            # a read that ended meanwhile (the last output, or the request's error) is moot: the client is gone
            await cancel_and_wait(pending, what=f"the read of request {self.rid}",
                                  expected=(StopAsyncIteration, EngineError))
            raise ClientDisconnected(self.rid)
        try:
            out = pending.result()
        except StopAsyncIteration:
            out = None
        return self._add(out)

    def _add(self, out: TokenOutput | None) -> TokenOutput:
        if out is None:
            raise EngineError("the engine ended the request without a finish reason", 500)
        self.state.add(out)
        return out

    async def outputs(self) -> AsyncIterator[TokenOutput]:
        while (out := await self.next_output()) is not None:
            yield out

    async def run_to_end(self) -> RequestState:
        async for _ in self.outputs():
            pass
        return self.state

    def close(self) -> None:
        """Idempotent. Aborts the request in the engine if it has not finished (client gone, error, cancellation)."""
        if self._closed:
            return
        self._closed = True
        if self._live.get(self.identity) is self:  # a later request with the same identity may have taken it
            del self._live[self.identity]
        if self._disconnect is not None:
            _abandon(self._disconnect)
        if not self.state.finished and not self._ended_by_engine:
            rid, room = self.identity
            try:  # by identity: on a PD node a retry of this request (the same rid, a new room) is not touched
                aborted = self.engine.abort(rid, room=room)
                log.info("request %s aborted before it finished (engine knew it: %s)", rid, aborted)
            except Exception:  # an abort must not turn a disconnect into a server error
                log.exception("engine.abort(%s) failed", rid)
