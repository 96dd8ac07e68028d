"""``create_app``: the HTTP server of one engine (prefill, decode or colocated), SGLang- and OpenAI-compatible."""

from __future__ import annotations

from collections.abc import Iterable

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from fsm_pd.api.auth import ApiKeyMiddleware
from fsm_pd.api.context import ApiContext
from fsm_pd.api.drain import DEFAULT_DRAIN_TIMEOUT_S, Drain, DrainGate
from fsm_pd.api.errors import install_error_handlers
from fsm_pd.api.info_routes import info_router
from fsm_pd.api.metrics import ApiMetrics, MetricsMiddleware
from fsm_pd.api.openai_routes import openai_router
from fsm_pd.api.runner import WaitDeadlines
from fsm_pd.api.sglang_routes import sglang_router
from fsm_pd.api.tokenize_routes import tokenize_router
from fsm_pd.net.body_limit import BodySizeLimit, request_bytes_for
from fsm_pd.serving.startup import Startup, StartupCollector
from fsm_pd.serving.types import Engine


def create_app(engine: Engine, tokenizer, *, api_key: str | None = None, model_name: str | None = None,
               model_path: str | None = None, bootstrap_port: int | None = None,
               registries: Iterable[CollectorRegistry] | None = None, model_info: dict | None = None,
               health_timeout_s: float = 30.0, max_body_bytes: int | None = None,
               drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S, startup: Startup | None = None,
               wait: WaitDeadlines | None = None) -> FastAPI:
    """The app serving ``engine``.

    * ``model_name``: the served model name (``/v1/models``, ``served_model_name``); defaults to
      ``engine.model_name``. ``model_path`` (default: the same) is also accepted as a model name.
    * ``bootstrap_port``: on a prefill node, its bootstrap server's port (reported as
      ``disaggregation_bootstrap_port``); on a decode node, the port used when a router sends ``bootstrap_port:
      null`` (SGLang's decode does the same with its own ``--disaggregation-bootstrap-port``).
    * ``registries``: Prometheus registries for ``/metrics``; default: ``engine.registries`` if the engine has it.
    * ``model_info``: extra ``/model_info`` fields, e.g. ``{"model_type": "llama", "architectures": [...]}``.
    * ``api_key``: require ``Authorization: Bearer <api_key>`` (except on /health* and /metrics).
    * ``drain_timeout_s``: how long a drain (SIGTERM under ``drain.serve_draining``, or ``POST /drain``) waits for
      open requests before it aborts them (``app.state.drain``; ``drain.py``).
    * ``startup``: the node's start-up (``serving/startup.py``): until it is ready, ``/health`` answers 503 with its
      progress and the generation routes refuse with 503 ``starting``; default: ready now.
    * ``wait``: how long a request waits for the engine's first token and for each next one (``runner.py``).
    * ``max_body_bytes``: larger request bodies get 413 before they are read (``net/body_limit.py``); default: from
      the engine's context (``request_bytes_for``). ``/health`` says it, for a router in front.
    """
    name = model_name or engine.model_name
    getattr(tokenizer, "max_token_bytes", None)  # worked out once now (a pass over the vocabulary), not on a request
    ctx = ApiContext(engine=engine, tokenizer=tokenizer, model_name=name, model_path=model_path or name,
                     bootstrap_port=bootstrap_port, model_info_extra=dict(model_info or {}),
                     max_request_bytes=max_body_bytes or request_bytes_for(engine.max_context))
    if registries is None:
        registries = getattr(engine, "registries", None) or ()
    metrics = ApiMetrics(registries)
    wait = wait or WaitDeadlines()
    ctx.wait = WaitDeadlines(wait.first_output_s, wait.idle_s,
                             expired=lambda name: metrics.deadline_expiries.labels(name).inc())
    ctx.drain = Drain(engine, ctx.live, timeout_s=drain_timeout_s, registry=metrics.registry, startup=startup)
    metrics.registry.register(StartupCollector(ctx.drain.startup))

    app = FastAPI(title=f"fsm-pd {engine.role} server", version="1",
                  description="SGLang-compatible (/generate) and OpenAI-compatible (/v1/*) serving of one engine.")
    app.state.ctx = ctx
    app.state.metrics = metrics
    app.state.drain = ctx.drain
    install_error_handlers(app)
    app.include_router(sglang_router(ctx))
    app.include_router(openai_router(ctx))
    app.include_router(tokenize_router(ctx))
    app.include_router(info_router(ctx, metrics, health_timeout_s=health_timeout_s))
    app.include_router(ctx.drain.routes())
    # Added last runs first: the key is checked before the body is read, and metrics see every answer (a drain's
    # 503s too).
    app.add_middleware(DrainGate, drain=ctx.drain)
    app.add_middleware(BodySizeLimit, max_bytes=ctx.max_request_bytes)
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app
