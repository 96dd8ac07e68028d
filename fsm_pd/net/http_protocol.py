"""The HTTP/1.1 connection protocol of every fsm-pd server: uvicorn's h11 protocol with read deadlines, and silence
toward clients that are gone.

**Read deadlines.** Uvicorn bounds only the idle time between two requests (``timeout_keep_alive``). A client that
opens a connection and sends nothing, or drips a header line or a body byte now and then, holds its connection (a
socket, a protocol object, for a body a request task) for as long as it likes; a few hundred of them starve a node.
One timer per connection is armed while the server waits for the client:

* **headers**: from the connection's start, or from the first byte of a next request on a kept-alive connection,
  until the request line and headers are complete;
* **body**: from the end of the headers until the whole body is in (a total, not an idle time: a slow drip is what
  it is for).

When a deadline passes the client gets ``408 Request Timeout`` (if no response has started) and the connection is
closed; a request task already running sees ``http.disconnect``, as for any client that went away. Waiting on the
server (a long generation, a stream) is never timed here: the client has said everything by then.

**Clients that are gone.** When a client drops a streamed answer, asyncio closes the transport at once but tells
uvicorn only a loop turn later (``connection_lost``). A stream relayed from buffered data (the router) writes many
chunks in that turn; asyncio drops each and, from the fifth, logs "socket.send() raised exception." for every one,
hundreds per cancelled stream. Here the first write to a closing transport marks the request's client as gone
instead, as ``connection_lost`` will: uvicorn drops the rest quietly, and the app hears ``http.disconnect`` now, so a
router cancels the stream's upstream legs without waiting.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

HEADER_TIMEOUT_ENV = "FSM_PD_HEADER_TIMEOUT_S"
BODY_TIMEOUT_ENV = "FSM_PD_BODY_TIMEOUT_S"
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0  # a 32 MiB body (the largest a node takes) at ~1 MB/s still fits


@dataclass(frozen=True, slots=True)
class ReadTimeouts:
    """Seconds a client gets for a request's headers and for its body; None: no limit."""

    header_s: float | None = DEFAULT_HEADER_TIMEOUT_S
    body_s: float | None = DEFAULT_BODY_TIMEOUT_S

    @classmethod
    def from_env(cls, header_s: float | None = None, body_s: float | None = None) -> ReadTimeouts:
        """Explicit values (flags) win, then ``$FSM_PD_HEADER_TIMEOUT_S`` / ``$FSM_PD_BODY_TIMEOUT_S``, then the
        defaults. A value <= 0 turns that limit off."""
        def pick(explicit: float | None, env: str, default: float) -> float | None:
            if explicit is None:
                text = os.environ.get(env, "").strip()
                try:
                    explicit = float(text) if text else default
                except ValueError:
                    raise ValueError(f"${env} must be a number of seconds, got {text!r}") from None
            return explicit if explicit > 0 else None

        return cls(pick(header_s, HEADER_TIMEOUT_ENV, DEFAULT_HEADER_TIMEOUT_S),
                   pick(body_s, BODY_TIMEOUT_ENV, DEFAULT_BODY_TIMEOUT_S))

    def protocol(self) -> type[H11Protocol]:
        """The protocol class to give uvicorn (``Config(http=...)``)."""
        return type("DeadlineH11Protocol", (DeadlineH11Protocol,), {"timeouts": self})


class DeadlineH11Protocol(H11Protocol):
    timeouts = ReadTimeouts()

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._waiting_for: str | None = None  # "headers" or "body" while a deadline is armed
        self._deadline = None

    # --- uvicorn's protocol events, each followed by a look at what the connection now waits for ---
    def connection_made(self, transport) -> None:
        super().connection_made(_GoneClientGuard(transport, self))
        self._watch()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._arm(None)
        super().connection_lost(exc)

    def client_gone(self) -> None:
        """A write found the transport closing: the client is gone (``connection_lost`` will follow)."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and not cycle.disconnected:
            cycle.disconnected = True
            cycle.message_event.set()

    # --- the deadline ---
    def _awaited(self) -> str | None:
        """What the server is waiting for the client to send, if anything a deadline applies to."""
        if self.transport is None or self.transport.is_closing():
            return None
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            return "body"
        # between requests uvicorn's keep-alive timer rules until a byte of the next request arrives (which
        # cancels it); a new connection has no such timer, so its first request is on the header clock at once
        if state is h11.IDLE and self.timeout_keep_alive_task is None:
            return "headers"
        return None

    def _watch(self) -> None:
        self._arm(self._awaited())

    def _arm(self, waiting_for: str | None) -> None:
        if waiting_for == self._waiting_for:
            return  # the clock keeps running from when this wait began: a drip does not reset it
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._waiting_for = waiting_for
        limit = {"headers": self.timeouts.header_s, "body": self.timeouts.body_s}.get(waiting_for)
        if limit is not None:
            self._deadline = self.loop.call_later(limit, self._expired, waiting_for, limit)

    def _expired(self, waiting_for: str, limit: float) -> None:
        self._deadline = None
        if self._awaited() != waiting_for:  # the wait ended in the same loop turn; nothing to do
            self._watch()
            return
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        log.info("closing the connection from %s: request %s not received within %g s", client, waiting_for, limit)
        cycle = self.cycle
        if cycle is None or not cycle.response_started:
            text = f"request {waiting_for} not received within {limit:g} s\n".encode()
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                                 b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(text), text))
        self._waiting_for = None
        self.transport.close()
        self.client_gone()  # the request task (if any) must stop now, not a loop turn later


class _GoneClientGuard:
    """The transport as uvicorn sees it: a write once it is closing goes nowhere and tells the protocol."""

    def __init__(self, transport, protocol: DeadlineH11Protocol):
        self._transport = transport
        self._protocol = protocol

    def write(self, data) -> None:
        if self._transport.is_closing():
            self._protocol.client_gone()
            return
        self._transport.write(data)

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


def add_read_timeout_flags(parser) -> None:
    """``--http-header-timeout`` and ``--http-body-timeout`` on a server's command line."""
    parser.add_argument("--http-header-timeout", type=float, default=None, metavar="SECONDS",
                        help=f"close a connection whose request headers take longer (default: ${HEADER_TIMEOUT_ENV}, "
                             f"else {DEFAULT_HEADER_TIMEOUT_S:g}; 0: no limit)")
    parser.add_argument("--http-body-timeout", type=float, default=None, metavar="SECONDS",
                        help=f"answer 408 and close when a request body takes longer (default: ${BODY_TIMEOUT_ENV}, "
                             f"else {DEFAULT_BODY_TIMEOUT_S:g}; 0: no limit)")


def read_timeouts_from_args(args) -> ReadTimeouts:
    return ReadTimeouts.from_env(getattr(args, "http_header_timeout", None), getattr(args, "http_body_timeout", None))
