"""SGLang's native routes: ``POST /generate`` and ``POST /abort_request`` (a rid with ``n`` > 1 or a batch aborts
every copy)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from fsm_pd.api.context import ApiContext
from fsm_pd.api.errors import ERROR_RESPONSES
from fsm_pd.api.fanout import answer_plan, stream_plan
from fsm_pd.api.outputs import RequestState
from fsm_pd.api.requests import from_generate
from fsm_pd.api.runner import RequestRun
from fsm_pd.api.schemas import AbortBody, GenerateBody
from fsm_pd.api.streaming import answer_stream, answer_whole
from fsm_pd.api.strict_json import StrictJSONRoute
from fsm_pd.serving.types import TokenOutput


def fanned_out(rid: str, live) -> list[str]:
    """``rid`` and the engine requests an ``n`` or batch request made of it (``{rid}-{k}``, api.requests)."""
    return [rid] + [other for other in live if other.startswith(rid + "-") and other[len(rid) + 1:].isdigit()]


def sglang_router(ctx: ApiContext) -> APIRouter:
    router = APIRouter(tags=["sglang"], route_class=StrictJSONRoute)

    @router.post("/generate", responses=ERROR_RESPONSES)
    async def generate(body: GenerateBody, request: Request) -> Response:
        """SGLang's /generate: ``{"text", "output_ids", "meta_info"}``; streamed, every chunk carries the whole
        text and ids so far (SGLang's default). A batch (``text``/``input_ids`` as a list) or ``n > 1``: a list of
        such answers, prompt-major."""
        plan = from_generate(ctx.node, ctx.tokenizer, body)
        if not plan.single and plan.stream:  # each chunk names its answer by "index", prompt-major (as SGLang's)
            return await stream_plan(ctx, plan, request, lambda i, state, out: [state.sglang_response() | {"index": i}])
        if not plan.single:  # a batch or n > 1: a list of answers, prompt-major (as SGLang's)
            prompt_logprobs = ctx.role != "decode"
            return await answer_plan(ctx, plan, request, lambda groups: [
                state.sglang_response(prompt_logprobs) for group in groups for state in group])
        gen = plan.requests[0]
        run = RequestRun(ctx.engine, gen, ctx.tokenizer, request, ctx.live, hide_output=plan.hide_output)
        if not gen.stream:
            # Both PD routers put the prefill's prompt logprobs in front of a whole decode answer's: a decode node
            # leaves its copy out. Streamed, sglang-router merges nothing (and the built-in router never prepends to
            # a list that covers the prompt), so the decode's copy is the one the client gets.
            prompt_logprobs = ctx.role != "decode"
            return await answer_whole(run, lambda state: state.sglang_response(prompt_logprobs))

        def chunk(state: RequestState, out: TokenOutput) -> list[dict]:
            return [state.sglang_response()]

        return await answer_stream(run, chunk)

    @router.post("/abort_request", responses=ERROR_RESPONSES)
    async def abort_request(body: AbortBody) -> dict:
        """Abort by ``rid`` (SGLang's body), or every request this server is running with ``abort_all``. Always 200,
        as SGLang answers; ``aborted`` lists the ids the engine knew and stopped."""
        rids = list(ctx.live) if body.abort_all else fanned_out(body.rid, ctx.live) if body.rid else []
        return {"aborted": [rid for rid in rids if ctx.engine.abort(rid)]}

    return router
