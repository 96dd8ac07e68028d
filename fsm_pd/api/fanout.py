"""Running a ``Plan`` of several engine requests (a batch of prompts, ``n`` or ``best_of`` copies) for one HTTP
request, whole or streamed: all at once, one disconnect watch for all of them, every one aborted if the client goes
away or one fails."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fsm_pd.api.context import ApiContext
from fsm_pd.api.errors import error_body
from fsm_pd.api.outputs import RequestState
from fsm_pd.api.requests import Plan
from fsm_pd.api.runner import RequestRun, wait_disconnect
from fsm_pd.api.streaming import CLIENT_CLOSED, DONE, SSE_HEADERS, sse
from fsm_pd.api.tasks import cancel_and_wait
from fsm_pd.serving.types import EngineError, TokenOutput

log = logging.getLogger(__name__)


async def run_plan(ctx: ApiContext, plan: Plan, request: Request) -> list[RequestState] | None:
    """Every request's final state, in plan order; None if the client went away. Raises the first EngineError."""
    runs: list[RequestRun] = []
    try:
        for gen in plan.requests:  # the internal runs watch no disconnect: one watch below covers them all
            runs.append(RequestRun(ctx.engine, gen, ctx.tokenizer, None, ctx.live, hide_output=plan.hide_output,
                                   wait=ctx.wait))
        # return_exceptions: every run's ending is retrieved here, none is left to be logged as never retrieved
        work = asyncio.ensure_future(asyncio.gather(*(run.run_to_end() for run in runs), return_exceptions=True))
        gone = asyncio.ensure_future(wait_disconnect(request))
        done: set = set()  # stays empty if the wait itself is cancelled: both tasks are then cancelled below
        try:
            done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await cancel_and_wait(*(task for task in (work, gone) if task not in done),
                                  what=f"a task of request {plan.requests[0].rid}")
        if work not in done:
            return None
        results = work.result()
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results
    finally:
        for run in runs:
            run.close()


def best(plan: Plan, states: list[RequestState]) -> list[list[RequestState]]:
    """Per prompt, the ``keep`` answers to give: all copies, or the best by the sum of output logprobs."""
    groups = [states[i:i + plan.copies] for i in range(0, len(states), plan.copies)]
    if plan.keep == plan.copies:
        return groups
    return [sorted(g, key=lambda s: -sum(lp or 0.0 for lp in s.logprobs))[:plan.keep] for g in groups]


async def answer_plan(ctx: ApiContext, plan: Plan, request: Request, render) -> Response:
    """``render(groups)`` turns the kept states (a list per prompt) into the JSON answer."""
    states = await run_plan(ctx, plan, request)
    if states is None:
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse(render(best(plan, states)))


IndexedRenderer = Callable[[int, RequestState, TokenOutput], list[dict]]


async def stream_plan(ctx: ApiContext, plan: Plan, request: Request, on_output: IndexedRenderer,
                      on_end: Callable[[list[RequestState]], list[dict]] | None = None,
                      head: list[dict] | None = None) -> Response:
    """Every request of a plan as one SSE stream, their chunks interleaved as outputs come; the renderer gets the
    request's index (prompt-major) to name it in each chunk. As a single stream, the headers wait for the first
    output, of every request here, so a failure before any token is a real HTTP status; a failure after is one
    error event. The client going away, or one request failing, aborts them all."""
    runs = [RequestRun(ctx.engine, gen, ctx.tokenizer, None, ctx.live, hide_output=plan.hide_output, wait=ctx.wait)
            for gen in plan.requests]
    gone = asyncio.ensure_future(wait_disconnect(request))
    firsts = asyncio.ensure_future(asyncio.gather(*(run.next_output() for run in runs), return_exceptions=True))

    async def end(*tasks: asyncio.Future) -> None:
        """Abort every run, then end ``tasks``. The runs first: once a stream is cancelled (its client went away),
        Starlette's cancel scope raises again at every await, so nothing after one would run."""
        for run in runs:
            run.close()
        await cancel_and_wait(*tasks, what=f"a task of request {plan.requests[0].rid}")

    try:
        done, _ = await asyncio.wait({firsts, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the handler itself is cancelled
        await end(firsts, gone)
        raise
    if firsts not in done:
        await end(firsts, gone)
        return Response(status_code=CLIENT_CLOSED)
    firsts_out = firsts.result()
    if failed := next((r for r in firsts_out if isinstance(r, BaseException)), None):
        await end(gone)
        raise failed  # an EngineError becomes its HTTP status through the app's handler

    async def events():
        # At most one unrendered output per request: the renderers read the request's state, which must hold
        # exactly the outputs rendered so far plus the one being rendered.
        reading: dict[asyncio.Future, int] = {}
        try:
            for chunk in head or ():
                yield sse(chunk)
            ready = list(enumerate(firsts_out))
            while ready:
                for index, out in ready:
                    if out is not None:
                        for chunk in on_output(index, runs[index].state, out):
                            yield sse(chunk)
                        reading[asyncio.ensure_future(runs[index].next_output())] = index
                ready = []
                if not reading:
                    break
                done, _ = await asyncio.wait({*reading, gone}, return_when=asyncio.FIRST_COMPLETED)
                if gone in done:
                    log.info("client of %s went away mid-stream", plan.requests[0].rid)
                    return
                for task in done:
                    index = reading.pop(task)
                    try:
                        ready.append((index, task.result()))
                    except EngineError as err:
                        yield sse(error_body(err.status, str(err)))
                        yield DONE
                        return
            for chunk in on_end([run.state for run in runs]) if on_end else ():
                yield sse(chunk)
            yield DONE
        finally:
            await end(gone, *reading)

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)
