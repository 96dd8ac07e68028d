"""SGLang's tokenizer and load routes on an engine node: ``/tokenize`` and ``/detokenize`` (also under ``/v1/``),
``/get_load``.

Shapes as SGLang's:

* ``POST /tokenize {"prompt": str | [str], "add_special_tokens": true}`` -> ``{"tokens": [ids] | [[ids]], "count":
  n | [n], "max_model_len": context}``.
* ``POST /detokenize {"tokens": [ids] | [[ids]], "skip_special_tokens": true}`` -> ``{"text": str | [str]}``.
* ``GET /get_load`` -> ``[{"dp_rank": 0, "num_reqs", "num_waiting_reqs", "num_tokens"}]`` (a list: one entry per
  data-parallel rank, and fsm-pd has one). Counted from the requests this server is running (no trip through the
  model thread, so a router may poll it often): ``num_waiting_reqs`` are those without an output yet, ``num_tokens``
  their prompt and output tokens together.
"""

from __future__ import annotations

from fastapi import APIRouter

from fsm_pd.api.context import ApiContext
from fsm_pd.api.errors import ERROR_RESPONSES, ApiError
from fsm_pd.api.request_checks import check_model, check_token_ids
from fsm_pd.api.schemas import DetokenizeBody, TokenizeBody
from fsm_pd.api.strict_json import StrictJSONRoute


def current_load(ctx: ApiContext) -> list[dict]:
    runs = list(ctx.live.values())
    waiting = sum(1 for run in runs if not run.state.output_ids and not run.state.finished)
    tokens = sum(len(run.state.request.input_ids) + len(run.state.output_ids) for run in runs)
    return [{"dp_rank": 0, "num_reqs": len(runs), "num_waiting_reqs": waiting, "num_tokens": tokens}]


def tokenize_router(ctx: ApiContext) -> APIRouter:
    router = APIRouter(tags=["tokenizer"], route_class=StrictJSONRoute)

    def tokenize(body: TokenizeBody) -> dict:  # sync: FastAPI runs it on a worker thread (a long text takes time)
        check_model(ctx.node, body.model)
        add = True if body.add_special_tokens is None else body.add_special_tokens
        if isinstance(body.prompt, str):
            ids = ctx.tokenizer.encode(body.prompt, add_special_tokens=add)
            return {"tokens": ids, "count": len(ids), "max_model_len": int(ctx.engine.max_context)}
        lists = [ctx.tokenizer.encode(text, add_special_tokens=add) for text in body.prompt]
        return {"tokens": lists, "count": [len(ids) for ids in lists], "max_model_len": int(ctx.engine.max_context)}

    async def detokenize(body: DetokenizeBody) -> dict:
        check_model(ctx.node, body.model)
        skip = True if body.skip_special_tokens is None else body.skip_special_tokens
        batched = bool(body.tokens) and isinstance(body.tokens[0], list)
        lists = body.tokens if batched else [body.tokens]
        for ids in lists:
            check_token_ids(ctx.node, ids, "tokens")
        try:
            texts = [ctx.tokenizer.decode(ids, skip_special_tokens=skip) for ids in lists]
        except Exception as err:  # a tokenizer that cannot decode these ids: the client's ids are the problem
            raise ApiError(400, f"tokens could not be decoded: {err}") from err
        return {"text": texts if batched else texts[0]}

    for prefix in ("", "/v1"):
        router.add_api_route(prefix + "/tokenize", tokenize, methods=["POST"], responses=ERROR_RESPONSES)
        router.add_api_route(prefix + "/detokenize", detokenize, methods=["POST"], responses=ERROR_RESPONSES)

    @router.get("/get_load")
    async def get_load() -> list[dict]:
        return current_load(ctx)

    return router
