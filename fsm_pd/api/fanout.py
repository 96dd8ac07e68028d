"""Running a ``Plan`` of several engine requests (a batch of prompts, ``n`` or ``best_of`` copies) for one HTTP
request, whole (not streamed): all at once, one disconnect watch for all of them, every one aborted if the client
goes away or one fails."""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from fsm_pd.api.context import ApiContext
from fsm_pd.api.outputs import RequestState
from fsm_pd.api.requests import Plan
from fsm_pd.api.runner import RequestRun, wait_disconnect
from fsm_pd.api.streaming import CLIENT_CLOSED


async def run_plan(ctx: ApiContext, plan: Plan, request: Request) -> list[RequestState] | None:
    """Every request's final state, in plan order; None if the client went away. Raises the first EngineError."""
    runs: list[RequestRun] = []
    try:
        for gen in plan.requests:  # the internal runs watch no disconnect: one watch below covers them all
            runs.append(RequestRun(ctx.engine, gen, ctx.tokenizer, None, ctx.live, hide_output=plan.hide_output))
        # return_exceptions: every run's ending is retrieved here, none is left to be logged as never retrieved
        work = asyncio.ensure_future(asyncio.gather(*(run.run_to_end() for run in runs), return_exceptions=True))
        gone = asyncio.ensure_future(wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work, gone):
                if task not in done:
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        await task
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
