"""Answering a request whole or as Server-Sent Events (``data: {json}`` lines, then ``data: [DONE]``, as SGLang and
OpenAI both do).

A streamed answer waits for the request's first output before it sends its headers: a request the engine fails
before its first token (a prefill whose KV transfer failed, a decode that lost its prefill) gets a real HTTP error
status, which is what a PD router needs to see to report the failure, instead of a 200 with an error event.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from fastapi.responses import JSONResponse, Response, StreamingResponse

from fsm_pd.api.errors import error_body
from fsm_pd.api.outputs import RequestState
from fsm_pd.api.runner import ClientDisconnected, RequestRun
from fsm_pd.serving.types import EngineError, TokenOutput

log = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, but logs and metrics say what happened
DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no cache or proxy holds the events back
# On a decode node's answer whose prompt it prefilled itself after a failed KV transfer (--on-transfer-failure
# recompute): the answer no longer depends on the prefill leg, so a router need not wait for it (a stopped prefill
# node would hold the client until its deadline).
RECOMPUTED_HEADER = "X-FSM-PD-KV-Recompute"


# Asked for by the fsm-pd router on a stream it can migrate: each chunk then says which tokens it carries, under
# PROGRESS_FIELD, which the router strips (``router/migrate.py``).
PROGRESS_HEADER = "X-FSM-PD-Progress"
PROGRESS_FIELD = "fsm_pd_progress"


# On every answer of a request the node served as one of PD's two paths (``meta_info.pd_route``, which only
# ``/generate`` answers carry): ``pd`` (its KV came from a prefill node) or ``local`` (prefilled here), and the router's
# reason; the built-in router passes them on (``ROUTE_HEADERS``), so an OpenAI client reads them too.
ROUTE_HEADER, ROUTE_REASON_HEADER = "X-FSM-PD-Route", "X-FSM-PD-Route-Reason"
ROUTE_HEADERS = (ROUTE_HEADER, ROUTE_REASON_HEADER)


def answer_headers(state: RequestState) -> dict:
    headers = {RECOMPUTED_HEADER: "1"} if state.meta.get("kv_recompute") else {}
    if route := state.meta.get("pd_route"):
        headers[ROUTE_HEADER] = str(route.get("path", ""))
        if reason := route.get("reason"):  # a header value is latin-1 on the wire; the router's reasons are ASCII
            headers[ROUTE_REASON_HEADER] = str(reason).encode("ascii", "replace").decode()
    return headers

ChunkRenderer = Callable[[RequestState, TokenOutput], list[dict]]
TailRenderer = Callable[[RequestState], list[dict]]


# Characters JSON leaves as they are but line readers split at: httpx's ``aiter_lines`` (the load bench's client and
# the built-in router's migrating and merging relays) splits like ``str.splitlines``, at U+0085, U+2028 and U+2029
# too, which cut an event's JSON in two (the tiny model's random bytes make them). Inside a JSON string, their
# escapes mean the same.
_LINE_BREAKS = str.maketrans({"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(payload: dict) -> bytes:
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS)
    return b"data: " + text.encode() + b"\n\n"


async def answer_whole(run: RequestRun, render: Callable[[RequestState], dict]) -> Response:
    try:
        state = await run.run_to_end()
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)
    finally:
        run.close()
    return JSONResponse(render(state), headers=answer_headers(state))


async def answer_stream(run: RequestRun, on_output: ChunkRenderer, on_end: TailRenderer | None = None,
                        head: list[dict] | None = None) -> Response:
    """SSE: ``head`` chunks, then ``on_output`` chunks for each output, ``on_end`` chunks, and ``[DONE]``.
    An engine error after the headers went out is one ``data: {"error": ...}`` event (SGLang's way), then [DONE].
    The events of the outputs that are here together (a dispatch's tokens) go out in one write: one event each,
    one pass through the ASGI send path and one socket write for them all."""
    reported = len(run.state.output_ids)  # a resumed stream's earlier tokens are the router's already
    try:
        first = await run.next_output()
    except ClientDisconnected:
        run.close()
        return Response(status_code=CLIENT_CLOSED)
    except BaseException:
        run.close()
        raise  # an EngineError becomes its HTTP status through the app's handler

    progress = run.http_request is not None and run.http_request.headers.get(PROGRESS_HEADER) == "1"

    async def events():
        nonlocal reported
        try:
            for chunk in head or ():
                yield sse(chunk)
            out = first
            while out is not None:
                events = []
                while out is not None:  # every output here already, in one write
                    chunks = on_output(run.state, out)
                    if progress and chunks:
                        ids = run.state.output_ids
                        chunks[-1][PROGRESS_FIELD] = {"ids": ids[reported:], "seed": run.state.request.seed}
                        reported = len(ids)
                    events += [sse(chunk) for chunk in chunks]
                    out = run.next_ready()
                if events:
                    yield b"".join(events)
                out = await run.next_output()
            for chunk in on_end(run.state) if on_end else ():
                yield sse(chunk)
            yield DONE
        except EngineError as err:
            yield sse(error_body(err.status, str(err)))
            yield DONE
        except ClientDisconnected:
            log.info("client of %s went away mid-stream", run.rid)
        finally:
            run.close()

    return StreamingResponse(events(), media_type="text/event-stream", headers={**SSE_HEADERS,
                                                                                 **answer_headers(run.state)})
