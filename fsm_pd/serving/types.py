"""What the HTTP layer and the engines exchange: a request in, token outputs back, an engine protocol between them.

An engine (prefill, decode or colocated) runs its model on the model thread and accepts requests from any thread.
The HTTP layer builds a ``GenerateRequest``, calls ``engine.submit``, and reads ``TokenOutput``s from the returned
``RequestStream`` (an async iterator, fed from the model thread through the event loop it was created on).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from fsm_pd.model.sampling_params import SamplingParams
from fsm_pd.net.unix_sockets import is_unix
from fsm_pd.serving.loop_mail import mail_for
from fsm_pd.transport.addresses import with_port


class EngineError(Exception):
    """A request failed inside the engine; ``status`` is the HTTP status the API should answer with."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class Bootstrap:
    """SGLang's PD fields, added by the router: where the prefill node's bootstrap server is, and the room."""

    host: str
    port: int
    room: int
    # the router chose the local path (``router/policy.py``): no prefill node; the decode node prefills the prompt
    # itself. The room still names the attempt (its identity, its seed) on that node.
    local: bool = False

    @property
    def addr(self) -> str:
        """``host:port``, an IPv6 host in brackets (whether the router sent them or not); a ``unix:PATH`` host as it
        is (a bootstrap server on a unix socket has no port)."""
        return self.host if is_unix(self.host) else with_port(self.host, self.port)


@dataclass(slots=True)
class GenerateRequest:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    seed: int  # SamplingParams.resolved_seed(), drawn once: P and D must sample with the same one
    stream: bool = False
    return_logprob: bool = False  # per-token output logprobs, and input_token_logprobs from prefill
    top_logprobs_num: int = 0  # with return_logprob: the k most likely tokens at each prompt and output position
    logprob_start_len: int = 0  # the API shows prompt logprobs from this position on (the engine computes all)
    text_in_logprobs: bool = False  # the API puts each logprob's token text in SGLang's third field
    bootstrap: Bootstrap | None = None  # required on prefill and decode nodes, absent on colocated ones
    # A migrated stream (``fsm_pd_resume``, read by ``api/requests.py``): the tokens it generated on a decode node
    # that failed. They end ``input_ids`` (their KV is prefilled like the prompt's) and begin its output: stop
    # strings, the grammar, penalties and the sampling step count them, and ``sampling.max_new_tokens`` is what is
    # left after them.
    generated_before: list[int] = field(default_factory=list)
    route: dict | None = None  # the router's path and reason (``fsm_pd_route``), journaled by a decode node

    @property
    def identity(self) -> tuple[str, int | None]:
        """Who this request is on a node: its rid and, on a PD node, its bootstrap room. Every attempt a router makes
        of one client request carries the client's rid and a new room, so a retry is a different request there, and
        an abort that names the room reaches only its own attempt. A colocated request (no room) is its rid."""
        return self.rid, self.bootstrap.room if self.bootstrap is not None else None


@dataclass(slots=True)
class TokenOutput:
    """One generated token, in order. The last one has ``finish_reason`` set (SGLang's shape:
    ``{"type": "length"}``, ``{"type": "stop", "matched": <id or string>}``, ``{"type": "abort", "message": ...}``).
    """

    token_id: int
    logprob: float | None = None
    finish_reason: dict | None = None
    text: str | None = None  # the request's whole output text so far (stop strings cut); set on the last token
    input_token_logprobs: list[float | None] | None = None  # from prefill, on the first token when asked for
    top_logprobs: list[tuple[float, int]] | None = None  # (logprob, token_id), best first, when asked for
    input_top_logprobs: list | None = None  # per prompt position (None at the first), on the first token
    meta: dict[str, Any] = field(default_factory=dict)  # e.g. prompt_tokens, cached_tokens, kv transfer seconds


class RequestStream:
    """Token outputs of one request, pushed from any thread, read with ``async for`` on the loop that made it.

    A reader that waits gets a future (``arrival``) that the next push resolves, not a task: a stream is read once
    per token, and with a task and ``asyncio.wait`` a token ``RequestRun.next_output`` held the event loop 65-84 us
    a token against 33-41 now (``bench/token_wait.py``, each commit back to back), on the loop the model thread
    shares the interpreter with."""

    def __init__(self, rid: str, loop: asyncio.AbstractEventLoop | None = None):
        self.rid = rid
        self._loop = loop or asyncio.get_running_loop()
        self._mail = mail_for(self._loop)  # the loop's wakes, shared with every other stream on it (loop_mail.py)
        self._items: collections.deque[TokenOutput | BaseException] = collections.deque()
        self._waiter: asyncio.Future | None = None

    def push(self, item: TokenOutput | BaseException) -> None:
        """Thread-safe: an output, or the exception that ends the request (an ``EngineError``)."""
        self._call(self._put_all, (item,))

    def push_many(self, items: list[TokenOutput]) -> None:
        """Thread-safe: several outputs in order (a dispatch's tokens of one request), as one call on the reader's
        loop."""
        if items:
            self._call(self._put_all, items)

    def take_ready(self) -> TokenOutput | None:
        """The reader's loop only: the next output if it is here already, else None (nothing to wait for); raises
        the exception that ends the request."""
        if not self._items:
            return None
        item = self._items.popleft()
        if isinstance(item, BaseException):
            raise item
        return item

    def arrival(self) -> asyncio.Future:
        """The reader's loop only: a future done once an item is here (at once if one is). Cancelling it, or
        resolving it from elsewhere (a disconnect, a deadline), loses nothing: the items stay queued."""
        waiter = self._loop.create_future()
        if self._items:
            waiter.set_result(None)
        else:
            self._waiter = waiter
        return waiter

    def _put_all(self, items) -> None:
        self._items.extend(items)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _call(self, callback, item) -> None:
        try:
            self._mail.post(callback, item)
        except RuntimeError:  # the reader's loop is closed (its server stopped): nobody is left to tell
            if not self._loop.is_closed():
                raise

    async def __aiter__(self) -> AsyncIterator[TokenOutput]:
        while True:
            if not self._items:
                await self.arrival()
                continue
            item = self.take_ready()
            yield item
            if item.finish_reason is not None:
                return


class Engine(Protocol):
    role: str  # "prefill", "decode" or "colocated"
    model_name: str
    max_context: int  # prompt + generated tokens must fit

    def submit(self, request: GenerateRequest, stream: RequestStream) -> None:
        """Start the request; outputs (or an EngineError) arrive on ``stream``. Raises EngineError(400) at once for
        a request this engine can never serve (too long, missing bootstrap fields on a PD node)."""

    def abort(self, rid: str, reason: str | None = None, status: int = 499, *, room: int | None = None) -> bool:
        """Stop the request and free what it holds; False if it is unknown or already finished. ``room`` None: every
        live request of ``rid`` (SGLang's meaning); a room: only the request with that identity, and if it has not
        arrived yet it is refused when it does. ``reason`` and ``status``: what the request's stream ends with
        (default: a client's abort, 499); a drain passes its own."""

    def info(self) -> dict:
        """Fields for /server_info: role, model, pages free/reserved, rooms by state, ..."""

    def close(self) -> None: ...
