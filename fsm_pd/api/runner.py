"""Running one request on an engine from a request handler, and aborting it when its client goes away.

A client that disconnects must free what its request holds (KV pages, a decode slot, a bootstrap room), so every
wait on the engine is raced against the ASGI ``http.disconnect`` message. A request that finished is never aborted.

Every wait on the engine is bounded too (``WaitDeadlines``): the first output within ``first_output_s`` of the
submit, each later one within ``idle_s`` of the wait's start (a deadline between tokens, not over the whole answer,
so a long generation is never cut). When one passes the request is aborted in the engine and ends with
``DeadlinePassed`` (504), whose message names the node, what it waited for and the flag that sets it: a streamed
answer whose 200 went out ends with that error event instead of going silent (SGLang #32267).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import Request

from fsm_pd.api.outputs import RequestState
from fsm_pd.serving.types import Engine, EngineError, GenerateRequest, RequestStream, TokenOutput
from fsm_pd.store.causes import REQUEST_CLOSED

log = logging.getLogger(__name__)


class ClientDisconnected(Exception):
    pass


@dataclass(frozen=True, slots=True)
class WaitDeadlines:
    """How long a request handler waits for its engine. The first output of a PD request comes once its room
    reached Success, which the room's own state deadlines bound (by default 660 s on a prefill node; on a decode node
    its address lookup, then free pages, READY and the transfer: 300 + 240 + 300 + 60 s, the lookup taking
    milliseconds in practice), so ``first_output_s`` is not shorter: those name the cause first. ``expired(name)``
    counts an expiry (``/metrics``)."""

    first_output_s: float = 900.0  # --first-token-timeout-secs
    idle_s: float = 240.0  # --token-idle-timeout-secs
    expired: Callable[[str], None] | None = None

    def __post_init__(self):
        if not (self.first_output_s > 0 and self.idle_s > 0):
            raise ValueError(f"the first-token and token-idle deadlines must be positive, got {self.first_output_s} "
                             f"and {self.idle_s}")


FIRST_TOKEN, TOKEN_IDLE = "first_token", "token_idle"  # the deadlines' names (metric labels)


class DeadlinePassed(EngineError):
    """A wait on the engine passed its deadline (504); ``deadline`` is its name."""

    def __init__(self, message: str, deadline: str):
        super().__init__(message, 504)
        self.deadline = deadline


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
                 live: dict[str, RequestRun] | None = None, *, hide_output: bool = False,
                 wait: WaitDeadlines | None = None):
        self.engine = engine
        self._wait = wait or WaitDeadlines()
        self._first_by = asyncio.get_running_loop().time() + self._wait.first_output_s
        self._live = live if live is not None else {}
        self.state = RequestState(request, tokenizer, hide_output=hide_output)
        self._http = http_request
        self._stream = RequestStream(request.rid)
        self._disconnect: asyncio.Task | None = None
        self._closed = False
        self._ended_by_engine = False
        self._outputs_seen = 0  # outputs read: the first is waited for up to first_output_s, each later one idle_s
        self._failed: Exception | None = None  # what ended the request, met by ``next_ready``: the next wait raises it
        self._abort_reason: str | None = None  # why close() aborts it, if not because its HTTP request closed
        if (scope_state := getattr(http_request, "state", None)) is not None:
            scope_state.rid = request.rid  # an error answer names the request (error.rid: api/errors.py)
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
        except DeadlinePassed:
            raise  # the engine still runs the request: close() aborts it
        except EngineError:
            # The engine ended the request and forgot it: on a colocated node an abort by its rid from now on could
            # only hit a later request with the same rid (on a PD node the abort names the room as well).
            self._ended_by_engine = True
            raise

    def next_ready(self) -> TokenOutput | None:
        """The next output if it is here already (added to ``state``), else None: nothing waits, so a stream writes
        every output that is here in one go (a dispatch of several steps brings a request several tokens at once).
        None too once the request finished, failed (``next_output`` raises why) or its client went away."""
        if self.state.finished or self._failed is not None or (self._disconnect is not None
                                                               and self._disconnect.done()):
            return None
        try:
            out = self._stream.take_ready()
        except Exception as exc:  # noqa: BLE001 - the engine's end of the request: the next wait raises it
            self._failed = exc
            return None
        if out is None:
            return None
        self._outputs_seen += 1
        return self._add(out)

    async def _next_output(self) -> TokenOutput | None:
        if self.state.finished:
            return None
        if (out := self.next_ready()) is not None:  # here already: no wait, no timer
            return out
        if self._failed is not None:
            raise self._failed
        if self._http is not None and self._disconnect is None:  # else an internal request (a health probe)
            self._disconnect = asyncio.ensure_future(wait_disconnect(self._http))  # one task a request, not a token
        first = self._outputs_seen == 0
        limit = self._first_by - asyncio.get_running_loop().time() if first else self._wait.idle_s
        # one future the next output, the client's going away and the deadline each resolve: no task a token
        arrival = self._stream.arrival()

        def wake(_: object = None) -> None:
            if not arrival.done():
                arrival.set_result(None)

        timer = asyncio.get_running_loop().call_later(max(0.0, limit), wake)
        if self._disconnect is not None:
            self._disconnect.add_done_callback(wake)
        try:
            await arrival
        finally:
            timer.cancel()
            if self._disconnect is not None:
                self._disconnect.remove_done_callback(wake)
        try:
            out = self._stream.take_ready()  # what came first wins: an output here is the client's
        except BaseException:
            self._outputs_seen += 1
            raise
        if out is not None:
            self._outputs_seen += 1
            return self._add(out)
        if self._disconnect is not None and self._disconnect.done():
            raise ClientDisconnected(self.rid)
        raise self._deadline_passed(first)

    def _deadline_passed(self, first: bool) -> DeadlinePassed:
        name = FIRST_TOKEN if first else TOKEN_IDLE
        if self._wait.expired is not None:
            self._wait.expired(name)
        node_id = getattr(self.engine, "node_id", None)
        who = f"{self.engine.role} node {node_id}" if node_id else f"{self.engine.role} engine"
        if first:
            message = (f"request {self.rid}: the {who} produced no first token within {self._wait.first_output_s:g} s "
                       "(first-token deadline, --first-token-timeout-secs)")
        else:
            message = (f"request {self.rid}: the {who} produced no token for {self._wait.idle_s:g} s after its "
                       f"output {self._outputs_seen} (token idle deadline, --token-idle-timeout-secs)")
        log.warning("%s; the request is aborted", message)
        self._abort_reason = f"aborted: {message}"  # what close() journals, not a closed request
        return DeadlinePassed(message, name)

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
                aborted = self.engine.abort(rid, room=room, reason=self._abort_reason or REQUEST_CLOSED)
                log.info("request %s aborted before it finished (engine knew it: %s)", rid, aborted)
            except Exception:  # an abort must not turn a disconnect into a server error
                log.exception("engine.abort(%s) failed", rid)
