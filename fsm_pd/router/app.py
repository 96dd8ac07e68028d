"""A small PD router speaking SGLang's protocol, with sglang-router's flags (``--prefill URL [BOOTSTRAP_PORT]``,
``--decode URL``, both repeatable).

For each generation request (``/generate``, ``/v1/completions``, ``/v1/chat/completions``): pick a prefill and a
decode worker among the healthy ones (``fleet.py``: health checks, a circuit breaker per worker, least outstanding
requests by default), add ``bootstrap_host`` / ``bootstrap_port`` /
``bootstrap_room`` (a random 63-bit room) to the client's JSON, send the same body to both at once, and answer with
the decode's response once the prefill's is complete (as sglang-router does). Neither leg is left waiting: the first
to fail (an error status, or unreachable) closes the other (which aborts the request there) and the client gets the
failed worker's status and error (502 when it was unreachable); ``--request-timeout-secs`` bounds the whole request,
streams included (504, or a final SSE error event), and within it each leg and a started stream's silence have
deadlines of their own that name themselves when they pass (``legs.RouterDeadlines``; docs/operations.md, Waits).
A worker failure before the answer starts (unreachable, a 5xx, silent past its leg's deadline) is retried on another
pair with a new bootstrap room and the same rid (``--max-retries``, a router-wide retry budget, ``--retry-policy
retry|fail``); a ``/generate`` stream whose decode breaks off or goes silent migrates (``migrate.py``).
A client that goes away cancels both legs. Attempts, retries and migration run in ``core.py``, the legs themselves in
``legs.py``; the other routes (abort, flush, tokenize, load, metrics) are ``routes.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import Body, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from fsm_pd.api.auth import ApiKeyMiddleware
from fsm_pd.api.errors import ERROR_RESPONSES, install_error_handlers
from fsm_pd.api.strict_json import StrictJSONRoute
from fsm_pd.net.body_limit import ROUTER_FALLBACK_BYTES, BodySizeLimit, byte_count
from fsm_pd.net.http_protocol import add_read_timeout_flags, read_timeouts_from_args
from fsm_pd.net.unix_sockets import UnixPathError, check_path, is_unix
from fsm_pd.router.cache_aware import CacheAwareSettings
from fsm_pd.router.core import DEFAULT_BREAKER, DEFAULT_STARTUP_WAIT_S, GENERATION_PATHS, PDRouter, PrefillWorker
from fsm_pd.router.fleet import POLICIES, BreakerSettings
from fsm_pd.router.legs import DEFAULT_DEADLINES, RouterDeadlines
from fsm_pd.router.metrics import RouterMetrics, RouterMetricsMiddleware
from fsm_pd.router.policy import DEFAULT_LOCAL_PREFILL_MAX_TOKENS, MODES, PolicySettings
from fsm_pd.router.retries import DEFAULT_RETRY, RETRY_POLICIES, RetrySettings
from fsm_pd.router.routes import install_router_routes

log = logging.getLogger(__name__)

__all__ = ["PDRouter", "PrefillWorker", "RetrySettings", "build_arg_parser", "create_router_app", "router_main"]


def create_router_app(prefill: Sequence[PrefillWorker | tuple[str, int | None] | str], decode: Sequence[str], *,
                      policy: str = "least_outstanding", api_key: str | None = None,
                      request_timeout_s: float = 1800.0, seed: int | None = None,
                      max_body_bytes: int | None = None, retry: RetrySettings = DEFAULT_RETRY,
                      breaker: BreakerSettings = DEFAULT_BREAKER, health_interval_s: float = 5.0,
                      health_timeout_s: float = 5.0, cache_aware: CacheAwareSettings | None = None,
                      deadlines: RouterDeadlines = DEFAULT_DEADLINES,
                      pd_policy: PolicySettings | None = None,
                      startup_wait_s: float = DEFAULT_STARTUP_WAIT_S,
                      local_apps: dict[str, Any] | None = None,
                      server_info_extra: Callable[[], dict] | None = None) -> FastAPI:
    """The router's app. ``prefill``: workers as ``PrefillWorker``, ``(url, bootstrap_port or None)`` or a bare
    URL; ``decode``: URLs. ``api_key``: required from clients and sent to the workers (as sglang-router does).
    ``max_body_bytes``: larger request bodies get 413 before they are read; default: the smallest limit its
    workers report on ``/health`` (a node's follows its context), ``ROUTER_FALLBACK_BYTES`` until one has.
    ``retry``, ``breaker``, ``health_*``: see ``fleet.py`` and ``docs/fleet.md``; ``cache_aware``: the knobs of
    ``policy="cache_aware"`` (``cache_aware.py``); ``deadlines``: each leg's and a stream's idle deadline
    (``legs.RouterDeadlines``); ``pd_policy``: which requests go through a prefill node (``policy.py``);
    ``startup_wait_s``: how long a request waits for a worker that is still starting. ``local_apps``: {unix socket
    path: the app of a worker in this process (``--role pd``)}, called directly instead of through its socket.
    ``server_info_extra()``: more fields for ``/server_info`` (``--role pd``: the process's start-up)."""
    workers = [w if isinstance(w, PrefillWorker) else PrefillWorker(w, None) if isinstance(w, str)
               else PrefillWorker(w[0], w[1]) for w in prefill]
    metrics = RouterMetrics()
    pd = PDRouter(workers, decode, policy=policy, api_key=api_key, request_timeout_s=request_timeout_s, seed=seed,
                  retry=retry, breaker=breaker, health_interval_s=health_interval_s,
                  health_timeout_s=health_timeout_s, metrics=metrics, cache_aware=cache_aware, deadlines=deadlines,
                  pd_policy=pd_policy, startup_wait_s=startup_wait_s, local_apps=local_apps)
    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        await pd.aclose()

    app = FastAPI(title="fsm-pd router", version="1", lifespan=lifespan,
                  description="A PD router: each request goes to one prefill and one decode worker at once.")
    app.state.router = pd
    app.state.metrics = metrics
    install_error_handlers(app)

    def body_limit() -> int:
        return max_body_bytes or pd.fleet.request_limit() or ROUTER_FALLBACK_BYTES

    for path in GENERATION_PATHS:
        def route(path: str = path):
            async def forward(request: Request, body: dict[str, Any] = Body(...)) -> Response:  # noqa: B008
                return await pd.dispatch(path, body, request)
            forward.__name__ = "forward_" + path.strip("/").replace("/", "_")
            return forward
        # strict JSON: NaN, Infinity or a lone surrogate gets a 400 here, not a 500 when the body is re-sent
        app.router.add_api_route(path, route(), methods=["POST"], responses=ERROR_RESPONSES,
                                 route_class_override=StrictJSONRoute)

    @app.get("/health")
    async def health() -> dict:
        pd.ensure_health_checks()
        admitted = {role: sum(w.admitted for w in ws) for role, ws in pd.fleet.workers.items()}
        # checked: every worker has had a health check; until then "admitted" counts workers nobody has seen yet
        return {"status": "ok", "prefill": len(pd.fleet.workers["prefill"]), "decode": len(pd.fleet.workers["decode"]),
                "admitted": admitted, "checked": pd.health.checked.is_set()}

    @app.get("/liveness")
    async def liveness() -> dict:
        """200 while the router's process serves HTTP (sgl-model-gateway's route): a restart is no cure for workers
        that are not ready."""
        return {"status": "alive"}

    @app.get("/readiness")
    async def readiness() -> Response:
        """200 once a request can be served (``PDRouter.readiness``), else 503 naming what it waits for."""
        await pd.first_checks()
        ready, body = pd.readiness()
        return JSONResponse(body, status_code=200 if ready else 503, headers=None if ready else {"Retry-After": "1"})

    @app.get("/health_generate")
    async def health_generate() -> Response:
        return await pd.health_generate()

    for path in ("/v1/models", "/model_info", "/get_model_info"):
        def proxied(path: str = path):
            async def get() -> Response:
                return await pd.model_get("/model_info" if path.endswith("model_info") else path)
            get.__name__ = "proxy_" + path.strip("/").replace("/", "_")
            return get
        app.add_api_route(path, proxied(), methods=["GET"])

    async def server_info() -> dict:
        pd.ensure_health_checks()
        return {"router": "fsm-pd", "policy": policy, "retry_policy": retry.policy, "max_retries": retry.max_retries,
                "migrate": retry.migrate,  # whether a broken stream continues on another pair
                "retry_budget": pd.budget.describe(),
                "prefill": [w.describe() for w in pd.fleet.workers["prefill"]],
                "decode": [w.describe() for w in pd.fleet.workers["decode"]],
                "requests_running": len(pd.running),  # rids the router is answering (and could abort) now
                "max_request_bytes": body_limit(), **(server_info_extra() if server_info_extra else {})}

    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, server_info, methods=["GET"])
    install_router_routes(app, pd, metrics)
    app.add_middleware(BodySizeLimit, max_bytes=body_limit)  # added before the key: the key is checked first
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(RouterMetricsMiddleware, metrics=metrics)  # last added runs first: it sees every answer
    return app


def parse_prefill_specs(specs: Sequence[Sequence[str]]) -> list[PrefillWorker]:
    """``--prefill URL [BOOTSTRAP_PORT|none]`` values, as sglang-router reads them; ``BOOTSTRAP`` may also be
    ``unix:PATH``, a bootstrap server on a unix socket."""
    workers = []
    for spec in specs:
        if not 1 <= len(spec) <= 2:
            raise ValueError(f"--prefill takes URL [BOOTSTRAP_PORT], got {' '.join(spec)}")
        port: int | str | None = None
        if len(spec) == 2 and is_unix(spec[1]):
            port = spec[1]
        elif len(spec) == 2 and spec[1].lower() != "none":
            try:
                port = int(spec[1])
            except ValueError:
                raise ValueError(f"--prefill {spec[0]}: bootstrap port {spec[1]!r} is not a number or 'none'") from None
        workers.append(PrefillWorker(spec[0], port))
    return workers


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fsm-pd router", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", nargs="+", action="append", required=True, metavar="URL [BOOTSTRAP_PORT]",
                        help="a prefill worker and its bootstrap port ('none' or omitted: decode's default); a worker "
                             "on a unix socket is unix:PATH, and its bootstrap server unix:PATH too (--prefill "
                             "unix:/run/p.sock unix:/run/p.bootstrap.sock)")
    parser.add_argument("--decode", action="append", required=True, metavar="URL",
                        help="a decode worker (http://HOST:PORT, or unix:PATH)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--uds", default=None, metavar="PATH",
                        help="serve the router's HTTP API on this unix socket instead of --host/--port (curl "
                             "--unix-socket PATH http://localhost/...; docs/operations.md, Serving over unix sockets)")
    parser.add_argument("--policy", choices=POLICIES, default="least_outstanding",
                        help="how a worker of each role is chosen among the healthy ones (default: least_outstanding, "
                             "the fewest requests in flight from this router, ties in turn; cache_aware: where the "
                             "request's longest prefix went, so the node's prefix cache holds it)")
    aware = parser.add_argument_group("--policy cache_aware (sglang-router's knobs and defaults)")
    aware.add_argument("--cache-threshold", type=float, default=0.3,
                       help="go where the longest prefix went only if it is more than this share of the request "
                            "(default 0.3); else to the worker with the smallest record")
    aware.add_argument("--balance-abs-threshold", type=int, default=64,
                       help="the fleet is imbalanced, and the least busy worker is chosen, when the busiest has more "
                            "than this many requests in flight over the idlest ... (default 64)")
    aware.add_argument("--balance-rel-threshold", type=float, default=1.5,
                       help="... and more than this times as many (default 1.5)")
    aware.add_argument("--max-tree-size", type=int, default=1 << 24,
                       help="characters of prefixes remembered per worker, least recently used dropped first "
                            "(default 16M)")
    fleet = parser.add_argument_group("health, circuit breaker and retries (docs/fleet.md)")
    fleet.add_argument("--health-check-interval-secs", type=float, default=5.0,
                       help="GET /health on every worker this often; any answer but 200 is a failure (default 5)")
    fleet.add_argument("--health-check-timeout-secs", type=float, default=5.0,
                       help="a health check without an answer within this is a failure (default 5)")
    fleet.add_argument("--health-failure-threshold", type=int, default=3,
                       help="consecutive failed health checks that eject a worker (default 3); a worker whose /health "
                            "says draining is ejected at once")
    fleet.add_argument("--cb-failure-threshold", type=int, default=3,
                       help="consecutive failed requests that eject a worker (default 3)")
    fleet.add_argument("--cb-timeout-duration-secs", type=float, default=10.0,
                       help="an ejected worker is re-admitted by the first good health check after this (default 10)")
    fleet.add_argument("--worker-startup-wait-secs", type=float, default=DEFAULT_STARTUP_WAIT_S,
                       help="a request that finds every worker it needs still starting (a router started with its "
                            "nodes) waits this long for one to be ready before its 503 (default "
                            f"{DEFAULT_STARTUP_WAIT_S:g}); /readiness is 503 until then")
    fleet.add_argument("--retry-policy", choices=RETRY_POLICIES, default="retry",
                       help="retry: a failure before the answer starts is tried on another pair with a new room, a "
                            "broken /generate stream migrates; fail: the client gets the failure (default retry)")
    fleet.add_argument("--max-retries", "--retry-max-retries", type=int, default=2,
                       help="retries and migrations per request (default 2)")
    fleet.add_argument("--retry-budget-ratio", type=float, default=0.2,
                       help="router-wide: retries over the window at most this x requests (default 0.2) ...")
    fleet.add_argument("--retry-budget-min-per-sec", type=float, default=10.0,
                       help="... but always this many per second (default 10)")
    fleet.add_argument("--retry-budget-window-secs", type=float, default=10.0, help="the budget's window (default 10)")
    parser.add_argument("--api-key", default=os.environ.get("FSM_PD_API_KEY"),
                        help="require 'Authorization: Bearer KEY' (default: $FSM_PD_API_KEY, else none)")
    parser.add_argument("--max-request-bytes", type=byte_count, default=None, metavar="N",
                        help="a request body over N bytes is answered 413 at once, before it is read (default: the "
                             "smallest limit its workers report on /health, each derived from its model's context; "
                             f"{ROUTER_FALLBACK_BYTES} until one has)")
    waits = parser.add_argument_group("deadlines: each ends the request with an error naming it (504 before the "
                                      "answer started, a final SSE error event after; docs/operations.md, Waits)")
    waits.add_argument("--request-timeout-secs", type=float, default=1800.0,
                       help="the whole request, its retries and a stream's last chunk included (default 1800)")
    waits.add_argument("--prefill-timeout-secs", type=float, default=DEFAULT_DEADLINES.prefill_s,
                       help="the prefill leg's whole answer: its queue, prefill and its end of the KV handoff; a leg "
                            "past it is retried on another pair like a failed one (default "
                            f"{DEFAULT_DEADLINES.prefill_s:g})")
    waits.add_argument("--decode-timeout-secs", type=float, default=None,
                       help="the decode leg until its answer starts: a stream's first token, or the whole answer "
                            "when not streamed (default: the request's deadline, so a long whole answer is not cut)")
    waits.add_argument("--stream-idle-timeout-secs", type=float, default=DEFAULT_DEADLINES.stream_idle_s,
                       help="a started stream that brings no chunk for this long ends with an error event naming "
                            "the decode worker (a /generate stream migrates to another decode instead); a deadline "
                            "between tokens, not over the answer, longer than a node's own "
                            f"--token-idle-timeout-secs (default {DEFAULT_DEADLINES.stream_idle_s:g})")
    parser.add_argument("--pd-disaggregation", action="store_true", help="accepted for sglang-router parity")
    selective = parser.add_argument_group("selective disaggregation (fsm_pd/router/policy.py, docs/serving.md)")
    selective.add_argument("--pd-policy", choices=MODES, default="auto",
                           help="which requests go through a prefill node: auto (default): prompts over "
                                "--local-prefill-max-tokens, and those up to twice that while the prefill side has "
                                "more prompts waiting; the rest go to the decode node alone, which prefills them "
                                "itself (docs/crossover.md: where PD pays); always: every request (classic PD, "
                                "sglang-router's); never: none (the decode nodes serve colocated)")
    selective.add_argument("--local-prefill-max-tokens", type=int, default=DEFAULT_LOCAL_PREFILL_MAX_TOKENS,
                           help="with auto: prompts of at most this many tokens (counted from input_ids, estimated from"
                                f" text) are prefilled on the decode node (default {DEFAULT_LOCAL_PREFILL_MAX_TOKENS}, "
                                "from the crossover measured so far: docs/crossover.md)")
    selective.add_argument("--prefill-serves-local", action="store_true",
                           help="with auto: the prefill workers run --serve-local (they serve both roles), so a "
                                "short prompt goes to the prefill worker instead of the decode worker when it has "
                                "fewer requests in flight from this router")
    selective.add_argument("--prefill-idle-window", type=int, default=50,
                           help="fsm_pd_router_prefill_idle_alarm looks at this many of the last requests (default 50)")
    parser.add_argument("--log-level", default="info")
    add_read_timeout_flags(parser)
    return parser


def router_app_from_args(args: argparse.Namespace) -> FastAPI:
    retry = RetrySettings(args.retry_policy, args.max_retries, args.retry_budget_ratio, args.retry_budget_min_per_sec,
                          args.retry_budget_window_secs)
    breaker = BreakerSettings(args.health_failure_threshold, args.cb_failure_threshold, args.cb_timeout_duration_secs)
    deadlines = RouterDeadlines(args.prefill_timeout_secs, args.decode_timeout_secs, args.stream_idle_timeout_secs)
    return create_router_app(parse_prefill_specs(args.prefill), args.decode, policy=args.policy,
                             api_key=args.api_key, request_timeout_s=args.request_timeout_secs, retry=retry,
                             breaker=breaker, health_interval_s=args.health_check_interval_secs,
                             health_timeout_s=args.health_check_timeout_secs,
                             cache_aware=CacheAwareSettings(args.cache_threshold, args.balance_abs_threshold,
                                                            args.balance_rel_threshold, args.max_tree_size),
                             deadlines=deadlines,
                             pd_policy=PolicySettings(args.pd_policy, args.local_prefill_max_tokens,
                                                      args.prefill_idle_window, args.prefill_serves_local),
                             startup_wait_s=args.worker_startup_wait_secs, max_body_bytes=args.max_request_bytes)


def router_main(argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None) -> None:
    """Run the router; ``parser``: the one to parse ``argv`` with (``fsm-pd serve`` gives its own, whose errors are
    one line), default ``build_arg_parser()``."""
    from fsm_pd.api.server import serve
    from fsm_pd.net.http_server import log_to_stderr

    parser = parser or build_arg_parser()
    args = parser.parse_args(argv)
    if args.uds is not None:
        try:
            check_path(args.uds, "--uds")
        except UnixPathError as err:  # one line, as every role says it
            print(f"fsm-pd router: {err}", file=sys.stderr)
            sys.exit(2)
    try:
        app = router_app_from_args(args)
    except ValueError as err:
        parser.error(str(err))
    log_to_stderr(args.log_level)  # with the time on every line, and no line per health check
    serve(app, args.host, args.port, log_level=args.log_level, read_timeouts=read_timeouts_from_args(args),
          uds=args.uds)

