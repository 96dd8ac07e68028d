"""OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions`` (whole or streamed), ``/v1/models``.

Streamed text arrives as increments (``delta``s); what an increment may not yet show is explained in
``api.outputs``. Token logprobs are the sampled token's, and with completions ``logprobs`` > 0 or chat
``top_logprobs`` > 0 that many alternatives per token. ``echo`` (whole answers): the prompt's text before the
completion's, and with ``logprobs`` the prompt's tokens, logprobs and alternatives before the output's (the first
prompt token's are null), which with ``max_tokens`` 0 or 1 is lm-eval's loglikelihood request.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from fsm_pd.api.context import ApiContext
from fsm_pd.api.errors import ERROR_RESPONSES, ApiError
from fsm_pd.api.fanout import answer_plan, stream_plan
from fsm_pd.api.outputs import RequestState, openai_finish_reason
from fsm_pd.api.request_checks import check_model
from fsm_pd.api.requests import build_plan, from_chat, from_completion
from fsm_pd.api.runner import RequestRun
from fsm_pd.api.schemas import ChatCompletionBody, CompletionBody
from fsm_pd.api.streaming import answer_stream, answer_whole
from fsm_pd.api.strict_json import StrictJSONRoute
from fsm_pd.api.tools import ToolStreamer, parse_tool_calls
from fsm_pd.serving.types import TokenOutput


def _usage(prompts: list[RequestState], answers: list[RequestState]) -> dict:
    """OpenAI's usage: each prompt once (however many answers it had), every answer's tokens, and how many prompt
    tokens came from the prefix cache (``prompt_tokens_details.cached_tokens``)."""
    prompt = sum(s.prompt_tokens for s in prompts)
    completion = sum(s.completion_tokens for s in answers)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in prompts)}}


def _matched_stop(state: RequestState):
    return (state.finish_reason or {}).get("matched")


def _token_texts(state: RequestState, start: int) -> list[str]:
    return [state.tokenizer.decode([tid], skip_special_tokens=False) for tid in state.output_ids[start:]]


def completion_logprobs(state: RequestState, start: int = 0, offset: int = 0, echo: bool = False) -> dict:
    """The legacy completions shape: ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``; with
    ``echo``, the prompt's tokens first."""
    tokens = _token_texts(state, start)
    values = list(state.logprobs[start:])
    tops = list(state.top_logprobs[start:])
    if echo:
        prompt = state.input_token_logprobs()
        tokens = [state.tokenizer.decode([tid], skip_special_tokens=False) for _, tid, _ in prompt] + tokens
        values = [lp for lp, _, _ in prompt] + values
        tops = list(state.input_top_logprobs or [None] * len(prompt)) + tops
    offsets, at = [], offset
    for token in tokens:
        offsets.append(at)
        at += len(token)
    top = None
    if state.request.top_logprobs_num:  # {token text: logprob} per token, null for the first prompt token
        top = [None if row is None else {_decode(state, tid): lp for lp, tid in row} for row in tops]
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": top, "text_offset": offsets}


def _decode(state: RequestState, tid: int) -> str:
    return state.tokenizer.decode([tid], skip_special_tokens=False)


def _chat_top(state: RequestState, row) -> list[dict]:
    return [{"token": (t := _decode(state, tid)), "logprob": lp, "bytes": list(t.encode())} for lp, tid in row or ()]


def chat_logprobs(state: RequestState, start: int = 0) -> dict:
    tokens = _token_texts(state, start)
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": _chat_top(state, top)}
                        for t, lp, top in zip(tokens, state.logprobs[start:], state.top_logprobs[start:],
                                              strict=True)]}


def openai_router(ctx: ApiContext) -> APIRouter:
    router = APIRouter(tags=["openai"], route_class=StrictJSONRoute)

    def envelope(state: RequestState, kind: str, prefix: str) -> dict:
        return {"id": f"{prefix}-{state.request.rid}", "object": kind, "created": int(time.time()),
                "model": ctx.model_name}

    def usage_tail(body, prefix: str, kind: str, prompts: int = 1):
        """The usage chunk (stream_options.include_usage) of a stream's answers; ``prompts``: how many prompts they
        answer (a batch counts each prompt once, however many copies)."""
        def tail(states: list[RequestState]) -> list[dict]:
            if not (body.stream_options or {}).get("include_usage"):
                return []
            copies = len(states) // prompts
            return [envelope(states[0], kind, prefix) | {"choices": [], "usage": _usage(states[::copies], states)}]
        return tail

    @router.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions(body: CompletionBody, request: Request) -> Response:
        plan = await build_plan(from_completion, ctx.node, ctx.tokenizer, body)
        echo = bool(body.echo)
        if echo and plan.stream:
            raise ApiError(400, "echo=true is served on whole answers only (stream=false)")
        want_logprobs = body.logprobs is not None

        def choice(state: RequestState, index: int) -> dict:
            text = state.text()
            if echo:
                text = ctx.tokenizer.decode(state.request.input_ids) + text
            return {"index": index, "text": text,
                    "logprobs": completion_logprobs(state, echo=echo) if want_logprobs else None,
                    "finish_reason": openai_finish_reason(state.finish_reason), "matched_stop": _matched_stop(state)}

        def answer(groups: list[list[RequestState]]) -> dict:
            states = [state for group in groups for state in group]
            return envelope(states[0], "text_completion", "cmpl") | {
                "choices": [choice(state, i) for i, state in enumerate(states)],
                "usage": _usage([g[0] for g in groups], states)}

        def chunk(index: int, state: RequestState, out: TokenOutput) -> list[dict]:
            sent_before = len(state.sent_text)
            delta = state.take_delta()
            if not delta and not state.finished:
                return []
            new = state.take_logprob_start()
            choice = {"index": index, "text": delta,
                      "logprobs": completion_logprobs(state, new, sent_before) if want_logprobs else None,
                      "finish_reason": openai_finish_reason(state.finish_reason)}
            if state.finished:
                choice["matched_stop"] = _matched_stop(state)
            return [envelope(state, "text_completion", "cmpl") | {"choices": [choice]}]

        tail = usage_tail(body, "cmpl", "text_completion", len(plan.prompts))
        if not plan.single:
            if plan.stream:
                return await stream_plan(ctx, plan, request, chunk, tail)
            return await answer_plan(ctx, plan, request, answer)
        gen = plan.requests[0]
        run = RequestRun(ctx.engine, gen, ctx.tokenizer, request, ctx.live, hide_output=plan.hide_output,
                         wait=ctx.wait)
        if not gen.stream:
            return await answer_whole(run, lambda state: answer([[state]]))
        return await answer_stream(run, lambda state, out: chunk(0, state, out), lambda state: tail([state]))

    @router.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionBody, request: Request) -> Response:
        plan = await build_plan(from_chat, ctx.node, ctx.tokenizer, body)

        def message(state: RequestState) -> tuple[dict, str | None]:
            text, reason = state.text(), openai_finish_reason(state.finish_reason)
            if plan.tools is None:
                return {"role": "assistant", "content": text}, reason
            content, calls = parse_tool_calls(text, plan.tools)
            if not calls:
                return {"role": "assistant", "content": text}, reason
            return ({"role": "assistant", "content": content, "tool_calls": [c.as_openai() for c in calls]},
                    "tool_calls" if reason == "stop" else reason)

        def chat_answer(groups: list[list[RequestState]]) -> dict:
            states = groups[0]
            choices = []
            for i, state in enumerate(states):
                msg, reason = message(state)
                choices.append({"index": i, "message": msg,
                                "logprobs": chat_logprobs(state) if state.request.return_logprob else None,
                                "finish_reason": reason, "matched_stop": _matched_stop(state)})
            return envelope(states[0], "chat.completion", "chatcmpl") | {"choices": choices,
                                                                           "usage": _usage(states[:1], states)}

        if not plan.single and not plan.stream:
            return await answer_plan(ctx, plan, request, chat_answer)
        gen = plan.requests[0]
        if not gen.stream:
            run = RequestRun(ctx.engine, gen, ctx.tokenizer, request, ctx.live, wait=ctx.wait)
            return await answer_whole(run, lambda state: chat_answer([[state]]))

        streamers = {i: ToolStreamer(plan.tools) for i in range(len(plan.requests))} if plan.tools is not None else {}

        def chunk(index: int, state: RequestState, out: TokenOutput) -> list[dict]:
            delta = state.take_delta()
            reason = openai_finish_reason(state.finish_reason)
            calls = []
            if (streamer := streamers.get(index)) is not None:  # text that may be a tool call is held back
                delta = streamer.feed(delta)
                if state.finished:
                    delta += streamer.finish()
                    calls = [c.as_openai(index=i) for i, c in enumerate(streamer.calls)]
            if not delta and not state.finished:
                return []
            new = state.take_logprob_start()
            logprobs = chat_logprobs(state, new) if gen.return_logprob else None
            if not calls:
                choice = {"index": index, "delta": {"content": delta} if delta else {}, "logprobs": logprobs,
                          "finish_reason": reason}
                return [envelope(state, "chat.completion.chunk", "chatcmpl") | {"choices": [choice]}]
            chunks = []
            if delta:
                chunks.append({"index": index, "delta": {"content": delta}, "logprobs": None, "finish_reason": None})
            chunks.append({"index": index, "delta": {"tool_calls": calls}, "logprobs": logprobs,
                           "finish_reason": "tool_calls" if reason == "stop" else reason})
            return [envelope(state, "chat.completion.chunk", "chatcmpl") | {"choices": [c]} for c in chunks]

        head = [{"id": f"chatcmpl-{gen.rid}", "object": "chat.completion.chunk", "created": int(time.time()),
                 "model": ctx.model_name,
                 "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]} for i in range(len(plan.requests))]
        tail = usage_tail(body, "chatcmpl", "chat.completion.chunk")
        if not plan.single:
            return await stream_plan(ctx, plan, request, chunk, tail, head)
        run = RequestRun(ctx.engine, gen, ctx.tokenizer, request, ctx.live, wait=ctx.wait)
        if plan.resumed:  # a migrated stream: its client has the head, and the text its parser has seen is re-fed
            head = []
            if 0 in streamers:
                streamers[0].feed(run.state.sent_text)
        return await answer_stream(run, lambda state, out: chunk(0, state, out), lambda state: tail([state]), head)

    def card() -> dict:
        return {"id": ctx.model_name, "object": "model", "created": ctx.created, "owned_by": "fsm-pd",
                "root": ctx.model_path, "max_model_len": int(ctx.engine.max_context)}

    @router.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [card()]}

    @router.get("/v1/models/{model_id:path}", responses={404: ERROR_RESPONSES[404]})
    async def one_model(model_id: str) -> dict:
        """OpenAI's retrieve-model: the card of the served model (by its name or path), else 404."""
        check_model(ctx.node, model_id)
        return card()

    return router
