"""SGLang's native routes: ``POST /generate`` and ``POST /abort_request`` (a rid with ``n`` > 1 or a batch aborts
every copy; with fsm-pd's ``room``, on a PD node, only the attempt in that room)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from fsm_pd.api.context import ApiContext
from fsm_pd.api.errors import ERROR_RESPONSES
from fsm_pd.api.fanout import answer_plan, stream_plan
from fsm_pd.api.outputs import RequestState
from fsm_pd.api.requests import PD_ROLES, build_plan, derive, from_generate
from fsm_pd.api.runner import RequestRun
from fsm_pd.api.schemas import AbortBody, GenerateBody
from fsm_pd.api.streaming import answer_stream, answer_whole
from fsm_pd.api.strict_json import StrictJSONRoute
from fsm_pd.serving.types import TokenOutput
from fsm_pd.store.causes import ABORT_BY_NAME, RETRY_ABORT


def fanned_out(rid: str, live) -> list[str]:
    """``rid`` and the engine requests an ``n`` or batch request made of it (``{rid}-{k}``, api.requests), among the
    rids in ``live``."""
    return [rid] + sorted({other for other in live if other.startswith(rid + "-") and other[len(rid) + 1:].isdigit()})


def named(rid: str, room: int | None, live) -> list[tuple[str, int | None]]:
    """The engine requests (rid, room) an abort of ``rid`` names: ``rid`` and its copies (``fanned_out``), each with
    the room it was given (copy ``k``: ``derive(room, k)``), or None for every request of that rid. ``(rid, room)``
    is named even when it is not live: the engine then remembers the room and refuses that request when it comes.
    An ``n`` or batch request's copy 0 keeps the room and is submitted first, so its refusal refuses them all."""
    names = fanned_out(rid, [live_rid for live_rid, _ in live])
    if room is None:
        return [(name, None) for name in names]
    return [(name, room if name == rid else derive(room, int(name[len(rid) + 1:]))) for name in names]


def _local(request) -> bool:
    return request.bootstrap is not None and request.bootstrap.local


def sglang_router(ctx: ApiContext) -> APIRouter:
    router = APIRouter(tags=["sglang"], route_class=StrictJSONRoute)

    @router.post("/generate", responses=ERROR_RESPONSES)
    async def generate(body: GenerateBody, request: Request) -> Response:
        """SGLang's /generate: ``{"text", "output_ids", "meta_info"}``; streamed, every chunk carries the whole
        text and ids so far (SGLang's default). A batch (``text``/``input_ids`` as a list) or ``n > 1``: a list of
        such answers, prompt-major."""
        plan = await build_plan(from_generate, ctx.node, ctx.tokenizer, body)
        if not plan.single and plan.stream:  # each chunk names its answer by "index", prompt-major (as SGLang's)
            return await stream_plan(ctx, plan, request, lambda i, state, out: [state.sglang_response() | {"index": i}])
        if not plan.single:  # a batch or n > 1: a list of answers, prompt-major (as SGLang's)
            prompt_logprobs = ctx.role != "decode" or _local(plan.requests[0])
            return await answer_plan(ctx, plan, request, lambda groups: [
                state.sglang_response(prompt_logprobs) for group in groups for state in group])
        gen = plan.requests[0]
        run = RequestRun(ctx.engine, gen, ctx.tokenizer, request, ctx.live, hide_output=plan.hide_output,
                         wait=ctx.wait)
        if not gen.stream:
            # Both PD routers put the prefill's prompt logprobs in front of a whole decode answer's: a decode node
            # leaves its copy out. Streamed, sglang-router merges nothing (and the built-in router never prepends to
            # a list that covers the prompt), so the decode's copy is the one the client gets.
            # (a request the decode node prefilled itself, fsm_pd_route local, has no prefill's copy to merge)
            prompt_logprobs = ctx.role != "decode" or _local(gen)
            return await answer_whole(run, lambda state: state.sglang_response(prompt_logprobs))

        def chunk(state: RequestState, out: TokenOutput) -> list[dict]:
            return [state.sglang_response()]

        return await answer_stream(run, chunk)

    @router.post("/abort_request", responses=ERROR_RESPONSES)
    async def abort_request(body: AbortBody) -> dict:
        """Abort by ``rid`` (SGLang's body): every live request of it; with ``room`` (fsm-pd's, what the built-in
        router sends) only the attempt in that room, which if it has not arrived yet is refused when it does. Or every
        request this server is running with ``abort_all``. Always 200, as SGLang answers; ``aborted`` lists the ids
        the engine knew and stopped."""
        room = body.room if ctx.role in PD_ROLES else None  # a colocated node ignores PD fields
        if body.abort_all:
            targets = list(ctx.live)
        elif body.rid:
            targets = named(body.rid, room, list(ctx.live))
        else:
            targets = []
        # journaled: a room named is the built-in router's wind-down of an attempt it retries (router/attempts.py)
        reason = RETRY_ABORT if room is not None and not body.abort_all else ABORT_BY_NAME
        return {"aborted": [rid for rid, room in targets if ctx.engine.abort(rid, room=room, reason=reason)]}

    return router
