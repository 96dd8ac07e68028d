"""The two legs of one PD request at the router, and why neither can leave the client waiting.

* Both legs start at once. Whichever fails first (an error status, or a worker that cannot be reached) closes the
  other: a closed connection is a client disconnect to that worker, which aborts the request there and ends its
  bootstrap room, so the partner is never left waiting for a peer that is gone.
* Every wait has a deadline that names itself when it passes (``RouterDeadlines``): the request's own (its whole
  answer, streams included), each leg's (the prefill's whole answer; the decode's until its stream's first token, or
  its whole answer when not streamed) and, once a stream started, one between its chunks (a decode node that answered
  200 and then went silent: SGLang #32267, where such streams waited for a 300 s default).
* Every failure reaches the client with a reason. Before the answer has started: an error status with a JSON body
  (the worker's own ``{"error": ...}`` body when it sent one, else one naming the worker and what it said). Once a
  stream has started: a final SSE ``data: {"error": ...}`` event and ``data: [DONE]``, never silence.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

import anyio
import httpx
from fastapi.responses import Response

from fsm_pd.api.errors import error_body, error_response
from fsm_pd.api.streaming import RECOMPUTED_HEADER
from fsm_pd.api.tasks import wait_ended
from fsm_pd.router.migrate import FinishWatch

log = logging.getLogger(__name__)

T = TypeVar("T")
DONE = b"data: [DONE]\n\n"
BROKEN_OFF = (httpx.ReadError, httpx.RemoteProtocolError)  # a connection that broke after the request went out
# the router's deadlines by name: the label of fsm_pd_router_deadline_expiries, and the flag that sets each
DEADLINE_FLAGS = {"request": "--request-timeout-secs", "prefill_leg": "--prefill-timeout-secs",
                  "decode_leg": "--decode-timeout-secs", "stream_idle": "--stream-idle-timeout-secs"}


@dataclass(frozen=True, slots=True)
class RouterDeadlines:
    """Each leg's deadline and a stream's idle deadline (the request's own is ``--request-timeout-secs``).

    ``prefill_s``: the prefill's whole answer (its queue, prefill and its end of the KV handoff, which the node's own
    state deadlines bound within 660 s by default). ``decode_s``: the decode's answer until it starts: a stream's
    first token, or the whole answer when not streamed; None is the request's deadline, so a long whole answer is not
    cut. ``stream_idle_s``: between two chunks of a started stream; a deadline between tokens, not over the answer,
    longer than a decode node's own (``--token-idle-timeout-secs``, 240 s), which names its cause first."""

    prefill_s: float = 1200.0
    decode_s: float | None = None
    stream_idle_s: float = 300.0

    def __post_init__(self):
        for name, value in (("prefill", self.prefill_s), ("decode", self.decode_s),
                            ("stream-idle", self.stream_idle_s)):
            if value is not None and not value > 0:
                raise ValueError(f"--{name}-timeout-secs must be positive, got {value}")


DEFAULT_DEADLINES = RouterDeadlines()


class Leg:
    """One worker call in flight. ``whole``: read the whole body (the prefill's); otherwise an event stream is left
    open for relaying. ``close()`` cancels the call or closes its response (the worker sees a disconnect)."""

    def __init__(self, side: str, worker_url: str, client: httpx.AsyncClient, url: str, body: dict, headers: dict,
                 *, whole: bool, timeout_s: float | None = None, deadline_name: str | None = None):
        self.side, self.worker_url = side, worker_url
        # which of the router's deadlines ``timeout_s`` is (``DEADLINE_FLAGS``): the side's leg, unless the leg
        # stands for another (a lone leg to a node that prefills and decodes the request is a decode leg)
        self.deadline_name = deadline_name or f"{side}_leg"
        self.lost = False  # its worker's health checks ejected it before it answered (``both_answered``)
        self.timed_out = False  # its own deadline passed before it answered (``both_answered``)
        self.timeout_s = timeout_s  # None: only the request's deadline bounds it
        now = asyncio.get_running_loop().time()
        self.deadline = now + timeout_s if timeout_s is not None else float("inf")
        self.response: httpx.Response | None = None
        self.body: bytes | None = None
        request = client.build_request("POST", url, json=body, headers=headers)
        # close() cancels the call through this scope, not with Task.cancel(): httpx runs on anyio, whose shielded
        # clean-up cannot hold off a native asyncio cancellation, and one that reached httpcore's close of the
        # connection left the socket open (the worker saw no disconnect and kept the request until it shut down)
        self._scope = anyio.CancelScope()
        self.task = asyncio.ensure_future(self._run(client, request, whole))

    async def _run(self, client: httpx.AsyncClient, request: httpx.Request, whole: bool) -> None:
        with self._scope:
            self.response = response = await client.send(request, stream=True)
            if whole or response.status_code >= 400 or not self.streaming:
                self.body = await response.aread()
        if self._scope.cancelled_caught:
            raise asyncio.CancelledError  # the call was closed: the task ends cancelled, as the callers expect

    @property
    def recomputed(self) -> bool:
        """A decode answer the node computed without the prefill's KV (its transfer failed): the prefill leg no
        longer matters to it."""
        return self.response is not None and self.response.headers.get(RECOMPUTED_HEADER) == "1"

    @property
    def streaming(self) -> bool:
        return self.response is not None and \
            self.response.headers.get("content-type", "").startswith("text/event-stream")

    def failure(self) -> Response | None:
        """Once the call is done: the answer to give the client if this leg failed, else None."""
        err = self.task.exception()
        if isinstance(err, httpx.HTTPError):
            return error_response(502, f"{self.side} worker {self.worker_url} failed: {type(err).__name__}: {err}",
                                  code=f"{self.side}_unreachable")
        if err is not None:
            raise err
        if self.response.status_code >= 400:
            return upstream_error(self.side, self.worker_url, self.response, self.body or b"")
        return None

    def unreachable(self) -> bool:
        """Once the call is done: it failed without an HTTP answer (refused, reset, broken off)."""
        return not self.task.cancelled() and isinstance(self.task.exception(), httpx.HTTPError)

    def refused(self) -> bool:
        """Once the call is done: nothing listened at the worker's address (the request never reached it)."""
        return not self.task.cancelled() and isinstance(self.task.exception(), httpx.ConnectError)

    def broke_off(self) -> bool:
        """Once the call is done: the worker had the request and the connection broke before its answer (the
        process died: reset, or closed without a response)."""
        return not self.task.cancelled() and isinstance(self.task.exception(), BROKEN_OFF)

    async def close(self) -> None:
        """Cancel the call, or close its response. The call is cancelled before anything is awaited: a caller
        cancelled while this waits for the call to end gets its CancelledError, and leaves nothing running (a
        cancelled call closes its own connection)."""
        if not self.task.done():
            # an HTTP error is the leg failing as it was closed: nobody asked about it; anything else is logged
            self._scope.cancel()
            await wait_ended(self.task, what=f"the {self.side} call to {self.worker_url}", expected=(httpx.HTTPError,))
        elif not self.task.cancelled():
            self.task.exception()  # retrieved: a failed leg that nobody asked about is not an error to log
        if self.response is not None:
            await self.response.aclose()


def upstream_error(side: str, worker_url: str, response: httpx.Response, body: bytes) -> Response:
    """A worker's error answer for the client: its own JSON error body as it is, else one that says who failed."""
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        return Response(body, status_code=response.status_code, media_type="application/json")
    text = body.decode("utf-8", errors="replace").strip()[:500] or response.reason_phrase
    return error_response(response.status_code, f"{side} worker {worker_url} answered {response.status_code}: {text}",
                          code=f"{side}_error")


def deadline_error(waiting_for: list[Leg], timeout_s: float) -> Response:
    who = " and ".join(f"the {leg.side} worker {leg.worker_url}" for leg in waiting_for)
    return error_response(504, f"no answer from {who} within the request deadline of {timeout_s:g} s "
                               f"({DEADLINE_FLAGS['request']})", code="request_timeout")


def leg_deadline_error(leg: Leg, stream: bool) -> Response:
    what = "sent no first token" if leg.deadline_name == "decode_leg" and stream else "did not answer"
    name = leg.deadline_name.replace("_", " ")
    return error_response(504, f"the {leg.side} worker {leg.worker_url} {what} within {leg.timeout_s:g} s (the "
                               f"{name}'s deadline, {DEADLINE_FLAGS[leg.deadline_name]})", code=f"{leg.side}_timeout")


async def both_answered(prefill: Leg, decode: Leg, deadline: float, timeout_s: float,
                        lost: tuple[asyncio.Event, asyncio.Event] | None = None,
                        *, prefill_body: bool = True, stream: bool = False) -> tuple[Leg | None, Response] | None:
    """Wait until the prefill's answer is complete and the decode's has started (or was read whole). Returns the
    failed leg (None: the request's deadline passed; a leg whose own deadline passed has ``timed_out``) and the
    client's error answer, else None. The first leg to fail decides:
    the caller closes both legs either way. ``lost``: the prefill's and the decode's worker's events, set when their
    health checks eject them (a stopped node never answers: its leg fails then instead of at the deadline).

    Without ``prefill_body`` (the client's answer needs nothing from it), a decode stream that started ends the wait:
    a node's stream starts with its first token, which a decode node has only once the KV arrived (or it
    recomputed the prompt), so the prefill's answer can no longer change this attempt. Waiting for it put the
    prefill node's own end of the handoff (the decode's acknowledgement, its HTTP answer) into every TTFT.

    A prefill node that dies (its connection breaks off, or its health checks eject it) while the decode leg is open
    does not end the attempt: the decode node holds the request and either recomputes the prompt itself (its answer
    starts; ``--on-transfer-failure recompute``) or fails its room on the dead peer within its heartbeat bound (2 to 3
    s) and answers 5xx, and only then is the attempt the prefill's failure. Ending it at once closed the decode leg,
    which cancelled a recompute under way, and the retry computed the prompt again."""
    pending = {prefill.task, decode.task}
    watchers = {asyncio.ensure_future(event.wait()): leg for event, leg in zip(lost or (), (prefill, decode),
                                                                               strict=False)}
    try:
        return await _both_answered(prefill, decode, deadline, timeout_s, pending, watchers, prefill_body, stream)
    finally:
        for watcher in watchers:
            watcher.cancel()


async def _both_answered(prefill: Leg, decode: Leg, deadline: float, timeout_s: float, pending: set,
                         watchers: dict[asyncio.Future, Leg], prefill_body: bool,
                         stream: bool) -> tuple[Leg | None, Response] | None:
    loop = asyncio.get_running_loop()
    dead: Response | None = None  # the failure of a prefill that died while the decode may recompute without it
    while pending:
        waiting = [leg for leg in (prefill, decode) if leg.task in pending]
        first_due = min([deadline] + [leg.deadline for leg in waiting])
        done, _ = await asyncio.wait(pending | set(watchers), timeout=max(0.0, first_due - loop.time()),
                                     return_when=asyncio.FIRST_COMPLETED)
        if not done:
            if first_due >= deadline:  # the request's own deadline: it ends here, whichever leg is slow
                return None, deadline_error(waiting, timeout_s)
            leg = next(leg for leg in waiting if leg.deadline <= first_due)  # the prefill first: it is the cause
            leg.timed_out = True
            log.warning("the %s leg on %s passed its deadline of %g s", leg.side, leg.worker_url, leg.timeout_s)
            return leg, leg_deadline_error(leg, stream)
        pending -= done
        for watcher in done & set(watchers):
            leg = watchers[watcher]
            del watchers[watcher]
            if leg.task in pending:  # still waiting for its answer
                leg.lost = True
                failed = error_response(502, f"{leg.side} worker {leg.worker_url} failed its health checks before "
                                             "it answered (dead, stopped or hung)", code=f"{leg.side}_lost")
                if leg is not prefill or decode.task not in pending:
                    return leg, failed
                pending.discard(prefill.task)  # the call stays open until the caller closes the attempt
                dead = _decode_decides(prefill, decode, failed)
        # the prefill's failure wins a tie: it is the cause when both fail at once (the decode then lost its KV)
        for leg in (prefill, decode):
            if leg.task in done and (failed := leg.failure()) is not None:
                if leg is prefill and prefill.broke_off() and decode.task in pending:
                    dead = _decode_decides(prefill, decode, failed)
                    continue
                log.info("%s worker %s failed (%d); the other leg is cancelled", leg.side, leg.worker_url,
                         failed.status_code)
                return (prefill, dead) if dead is not None else (leg, failed)
        if prefill.task in pending and decode.task not in pending and decode.recomputed:
            log.info("decode worker %s recomputed the prompt: the prefill leg is not waited for", decode.worker_url)
            return None
        # the decode's answer started (a stream) or is whole: a prefill that fails or hangs after the KV went over
        # must not take it away (the client would get an error, or wait out --prefill-timeout-secs, for an answer
        # the router holds)
        if (prefill.task in pending and decode.task not in pending and not prefill_body
                and (decode.streaming or decode.body is not None)):
            return None
    return None


def _decode_decides(prefill: Leg, decode: Leg, failed: Response) -> Response:
    log.warning("prefill worker %s died before it answered (%s); waiting for the decode worker %s, which recomputes "
                "the prompt itself or fails its room on the dead peer", prefill.worker_url,
                json.loads(failed.body)["error"]["message"] if failed.body else failed.status_code, decode.worker_url)
    return failed


class WorkerLost(Exception):
    """The worker's health checks ejected it (dead, stopped, hung) while its stream was being read."""


class StreamIdle(TimeoutError):
    """A stream's next item did not come within its idle deadline (the request's own deadline had not passed)."""

    def __init__(self, idle_s: float):
        super().__init__(f"nothing for {idle_s:g} s")
        self.idle_s = idle_s


def idle_message(worker_url: str, idle_s: float) -> str:
    return (f"decode worker {worker_url} sent no token for {idle_s:g} s (stream idle deadline, "
            f"{DEADLINE_FLAGS['stream_idle']})")


async def until(items: AsyncIterator[T], deadline: float, lost: asyncio.Event | None = None,
                idle_s: float | None = None) -> AsyncIterator[T]:
    """``items``, raising TimeoutError when the next one has not come by ``deadline`` (the event loop's clock),
    StreamIdle when it has not come ``idle_s`` after it was asked for (sooner than the deadline), and WorkerLost once
    ``lost`` is set (a stopped node keeps its connections open: only its health checks tell)."""
    iterator = aiter(items)
    waiting: asyncio.Timeout | None = None
    fired = False

    async def watch() -> None:  # one task per stream, not one per item: it cuts the wait short through its timeout
        nonlocal fired
        await lost.wait()
        fired = True
        if waiting is not None:
            waiting.reschedule(asyncio.get_running_loop().time())

    watcher = asyncio.ensure_future(watch()) if lost is not None else None
    loop = asyncio.get_running_loop()
    try:
        while True:
            if fired:
                raise WorkerLost
            due = deadline if idle_s is None else min(deadline, loop.time() + idle_s)
            try:
                async with asyncio.timeout_at(due) as waiting:  # not around the yield: the consumer's time
                    item = await anext(iterator)
            except StopAsyncIteration:
                return
            except TimeoutError:
                if fired:
                    raise WorkerLost from None
                if due < deadline:
                    raise StreamIdle(idle_s) from None
                raise
            finally:
                waiting = None
            yield item
    finally:
        if watcher is not None:
            watcher.cancel()


def deadline_message(timeout_s: float) -> str:
    return f"the stream did not finish within the request deadline of {timeout_s:g} s ({DEADLINE_FLAGS['request']})"


def lost_message(worker_url: str) -> str:
    return f"decode worker {worker_url} failed its health checks mid-stream (dead, stopped or hung)"


def broke_off_message(worker_url: str, err: Exception) -> str:
    return f"decode worker {worker_url} broke off its stream: {type(err).__name__}: {err}"


def no_done_message(worker_url: str) -> str:
    return f"decode worker {worker_url} ended its stream without [DONE]"


def ends_with_done(tail: bytes) -> bool:
    return tail.rstrip().endswith(b"data: [DONE]")


def stream_end(problem: tuple[int, str], finish: FinishWatch, worker_url: str) -> bytes:
    """What ends a relayed stream that broke (``problem``: the status and message of its error event): ``[DONE]``
    alone when its finish went out already, else an error event and ``[DONE]``."""
    if finish.finished:  # the last token and its finish reason went out: only [DONE] is missing
        log.info("stream from %s ended after its finish: %s", worker_url, problem[1])
        return DONE
    log.warning("stream from %s ended early: %s", worker_url, problem[1])
    return b"data: " + json.dumps(error_body(*problem), separators=(",", ":")).encode() + b"\n\n" + DONE


async def relay(source: AsyncIterator[bytes], response: httpx.Response, worker_url: str, deadline: float,
                timeout_s: float, lost: asyncio.Event | None = None, idle_s: float | None = None,
                expired: Callable[[str], None] | None = None) -> AsyncIterator[bytes]:
    """Pass an event stream through; if it breaks, stalls past the deadline or ``idle_s`` between chunks, its worker
    is ejected as unhealthy (``lost``) or it ends without ``[DONE]``, finish it with an error event and ``[DONE]``
    so the client always learns how its request ended. ``expired(name)`` counts a deadline that ended it.
    (A stream of an engine of this process goes to the client without this generator: ``passthrough.py``.)"""
    tail, finish = b"", FinishWatch()
    try:
        try:
            async for chunk in until(source, deadline, lost, idle_s):
                tail = (tail + chunk)[-32:]
                finish.feed(chunk)
                yield chunk
        except StreamIdle as idle:
            problem = 504, idle_message(worker_url, idle.idle_s)
            if expired is not None:
                expired("stream_idle")
        except TimeoutError:
            problem = 504, deadline_message(timeout_s)
            if expired is not None:
                expired("request")
        except WorkerLost:
            problem = 502, lost_message(worker_url)
        except httpx.HTTPError as err:
            problem = 502, broke_off_message(worker_url, err)
        else:
            if ends_with_done(tail):
                return
            problem = 502, no_done_message(worker_url)
        yield stream_end(problem, finish, worker_url)
    finally:
        await response.aclose()
