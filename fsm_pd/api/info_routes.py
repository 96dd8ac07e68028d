"""Health, info and metrics routes: what sglang-router probes when it registers a worker and while it routes.

* ``GET /health`` (readiness): 200 while the engine can serve, ``{"status": "ok", "max_request_bytes": N}`` (its
  body limit, which the built-in router adopts) and on a decode node ``"prealloc_queue": N,
  "prealloc_oldest_wait_s": S`` (its requests waiting for free KV pages); 503
  ``{"status": "unhealthy", "reason": ...}`` once it cannot (its node loop stopped, its model thread died: the
  engine's ``health()``; or a ``healthy`` flag). Without either, a running server is healthy. sglang-router requires
  a 200 here before it routes to the worker, so a node that is still starting answers 503 ``{"status": "starting",
  "phase": ..., "progress": ...}`` (``startup.py``), and a draining node 503 ``{"status": "draining", ...}``
  (``drain.py``), here and on ``/health_generate``.
* ``GET /livez`` (liveness): 200 while the process serves HTTP and its engine threads are alive, starting and
  draining included; 503 with the reason once the engine cannot serve again (a restart is the cure).
* ``GET /startupz`` (start-up): 503 with the start-up's progress until the node was ready once, 200 from then on
  (draining included): an orchestrator's startup probe, which holds the liveness probe back while the node starts.
* ``GET /health_generate``: on a colocated node, a real 1-token greedy generation (SGLang's meaning). On a prefill or
  decode node a generation needs a partner node and a bootstrap room, and SGLang's trick (a fake bootstrap host that
  skips the transfer) has no counterpart in fsm-pd's engines; so there it checks that the engine answers ``info()``
  (which goes through its model thread) within the timeout. 200 or 503 with the reason.
* ``GET /server_info`` and ``/model_info`` (and the older ``/get_server_info``, ``/get_model_info`` that the router
  falls back to): the fields sglang-router keeps as worker labels (``model_path``, ``served_model_name``,
  ``tp_size``, ``dp_size``, ``disaggregation_mode``, ``model_type``, ``architectures``) and the PD fields
  (``disaggregation_bootstrap_port``), plus the engine's own ``info()`` under ``internal_states``.
* ``GET /metrics``: Prometheus text of the engine's registries and the API's own.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from fsm_pd.api.context import ApiContext
from fsm_pd.api.metrics import ApiMetrics
from fsm_pd.api.requests import new_rid
from fsm_pd.api.runner import RequestRun
from fsm_pd.model.sampling_params import SamplingParams
from fsm_pd.serving.types import GenerateRequest

log = logging.getLogger(__name__)

INFO_TIMEOUT_S = 5.0  # a router's registration waits on /server_info; a busy engine must not hold it up for long


def health_problem(engine) -> str | None:
    """Why the engine cannot serve, or None. An engine says so through ``health()`` (the reason, or None; the PD
    and colocated engines: a stopped node loop, a dead model thread) or a ``healthy`` flag."""
    try:
        probe = getattr(engine, "health", None)
        if callable(probe):
            return probe()
        healthy = getattr(engine, "healthy", True)
        return None if (healthy() if callable(healthy) else healthy) else "the engine reports that it is unhealthy"
    except Exception as err:  # a probe that breaks is an answer too
        return f"the health check failed: {type(err).__name__}: {err}"


def _healthy(ctx: ApiContext) -> Response:
    """200 ``{"status": "ok", "max_request_bytes": N, ...}``: the node's body limit (a router in front refuses what
    its workers would), and what the engine tells of its queues (``health_fields()``: a decode node's
    pre-allocation queue, the requests waiting for free KV pages)."""
    fields = getattr(ctx.engine, "health_fields", None)
    return JSONResponse({"status": "ok", "max_request_bytes": ctx.max_request_bytes,
                         **(fields() if callable(fields) else {})})


def _unhealthy(reason: str) -> JSONResponse:
    return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)


async def _engine_info(ctx: ApiContext, timeout_s: float) -> dict:
    info = await asyncio.wait_for(asyncio.to_thread(ctx.engine.info), timeout_s)
    return dict(info or {})


def info_router(ctx: ApiContext, metrics: ApiMetrics, *, health_timeout_s: float) -> APIRouter:
    router = APIRouter(tags=["info"])

    def not_serving() -> Response | None:
        """The readiness answer of a node that takes no requests now, or None."""
        if ctx.drain is not None and not ctx.drain.startup.ready:
            return ctx.drain.starting_answer()
        if ctx.drain is not None and ctx.drain.draining:
            return ctx.drain.health_answer()
        if (reason := health_problem(ctx.engine)) is not None:
            return _unhealthy(reason)
        return None

    @router.get("/health")
    async def health() -> Response:
        return not_serving() or _healthy(ctx)

    @router.get("/livez")
    async def livez() -> Response:
        if (reason := health_problem(ctx.engine)) is not None:
            return _unhealthy(reason)
        return JSONResponse({"status": "alive"})

    @router.get("/startupz")
    async def startupz() -> Response:
        if ctx.drain is not None and not ctx.drain.startup.ready:
            return ctx.drain.starting_answer()
        return JSONResponse({"status": "started"})

    @router.get("/health_generate")
    async def health_generate() -> Response:
        if (answer := not_serving()) is not None:
            return answer
        try:
            if ctx.role == "colocated":
                await asyncio.wait_for(_one_token(ctx), health_timeout_s)
            else:
                await _engine_info(ctx, health_timeout_s)
        except TimeoutError:
            return _unhealthy(f"no answer within {health_timeout_s}s")
        except Exception as err:  # whatever broke, the answer is "unhealthy", with what broke
            return _unhealthy(f"{type(err).__name__}: {err}")
        return Response(status_code=200)

    async def server_info() -> dict:
        try:
            engine_info = await _engine_info(ctx, INFO_TIMEOUT_S)
        except Exception as err:  # the static fields are what a router needs; report the engine part's failure
            log.warning("engine.info() failed for /server_info: %s", err)
            engine_info = {"error": f"{type(err).__name__}: {err}"}
        return {
            "model_path": ctx.model_path,
            "tokenizer_path": ctx.model_path,
            "served_model_name": ctx.model_name,
            "tp_size": int(engine_info.get("tp_size", 1)),
            "dp_size": int(engine_info.get("dp_size", 1)),
            "pp_size": 1,
            "load_balance_method": "round_robin",
            "context_length": int(ctx.engine.max_context),
            "disaggregation_mode": ctx.disaggregation_mode,
            "disaggregation_bootstrap_port": ctx.bootstrap_port,
            "disaggregation_transfer_backend": engine_info.get("transfer_backend"),
            "role": ctx.role,
            "version": _version(),
            "internal_states": [engine_info],
            "startup": ctx.drain.startup.status() if ctx.drain is not None else None,
        }

    async def model_info() -> dict:
        return {
            "model_path": ctx.model_path,
            "tokenizer_path": ctx.model_path,
            "served_model_name": ctx.model_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            **_model_identity(ctx),
            **ctx.model_info_extra,
        }

    for path in ("/server_info", "/get_server_info"):
        router.add_api_route(path, server_info, methods=["GET"])
    for path in ("/model_info", "/get_model_info"):
        router.add_api_route(path, model_info, methods=["GET"])

    async def flush_cache() -> Response:
        """SGLang's: 200 and a message when flushed, 400 while requests are live (the engine's ``flush_cache()``)."""
        flush = getattr(ctx.engine, "flush_cache", None)
        if flush is None:
            return PlainTextResponse("Cache flushed (this engine keeps no cache).\n")
        ok, message = await asyncio.to_thread(flush)
        return PlainTextResponse(message + "\n", status_code=200 if ok else 400)

    for method in ("GET", "POST"):  # one route per method: a shared route gives OpenAPI one id twice
        router.add_api_route("/flush_cache", flush_cache, methods=[method],
                             operation_id=f"flush_cache_{method.lower()}")

    @router.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    return router


async def _one_token(ctx: ApiContext) -> None:
    ids = ctx.tokenizer.encode("hi")[:8] or [0]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True, seed=0)
    request = GenerateRequest(rid=f"health-{new_rid()}", input_ids=ids,
                              sampling=sampling, seed=0)
    run = RequestRun(ctx.engine, request, ctx.tokenizer, None)
    try:
        await run.run_to_end()
    finally:
        run.close()


def _model_identity(ctx: ApiContext) -> dict:
    """``model_type`` and ``architectures`` as the checkpoint's config.json names them (from the loaded config);
    null for an engine without a model."""
    config = ctx.model_config
    if config is None:
        return {"model_type": None, "architectures": None}
    hf = config.to_hf()
    return {"model_type": hf.get("model_type"), "architectures": hf.get("architectures"),
            "vocab_size": int(config.vocab_size)}


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("fsm-pd")
    except Exception:
        return "unknown"
