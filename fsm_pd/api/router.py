"""A small PD router speaking SGLang's protocol, with sglang-router's flags (``--prefill URL [BOOTSTRAP_PORT]``,
``--decode URL``, both repeatable).

For each generation request (``/generate``, ``/v1/completions``, ``/v1/chat/completions``): pick a prefill and a
decode worker (round robin or random, each side on its own), add ``bootstrap_host`` / ``bootstrap_port`` /
``bootstrap_room`` (a random 63-bit room) to the client's JSON, send the same body to both at once, and answer with
the decode's response once the prefill's is complete (as sglang-router does). Neither leg is left waiting: the first
to fail (an error status, or unreachable) closes the other (which aborts the request there) and the client gets the
failed worker's status and error (502 when it was unreachable); ``--request-timeout-secs`` bounds the whole request,
streams included (504, or a final SSE error event). No retries: a failed request is reported. A client that goes
away cancels both legs. The legs themselves are ``router_legs.py``; the other routes (abort, flush, tokenize, load,
metrics) ``router_routes.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import Body, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fsm_pd.api.app import DEFAULT_MAX_BODY_BYTES
from fsm_pd.api.auth import ApiKeyMiddleware
from fsm_pd.api.errors import ERROR_RESPONSES, error_response, install_error_handlers
from fsm_pd.api.requests import new_rid
from fsm_pd.api.router_legs import Leg, both_answered, relay, until
from fsm_pd.api.router_merge import merge_json, merge_sse, new_room, prefill_input_logprobs, with_bootstrap
from fsm_pd.api.router_metrics import RouterMetrics, RouterMetricsMiddleware
from fsm_pd.api.router_routes import RunningRequests, install_router_routes, released
from fsm_pd.api.runner import wait_disconnect
from fsm_pd.api.strict_json import StrictJSONRoute
from fsm_pd.bootstrap.body_limit import BodySizeLimit
from fsm_pd.http_protocol import add_read_timeout_flags, read_timeouts_from_args

log = logging.getLogger(__name__)

POLICIES = ("round_robin", "random")
GENERATION_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
PROBE_TIMEOUT_S = 45.0  # health and info probes; longer than a worker's own /health_generate limit (30 s)


@dataclass(frozen=True, slots=True)
class PrefillWorker:
    url: str
    bootstrap_port: int | None  # None: decode uses its own default (SGLang's "null")


class Picker:
    def __init__(self, items: Sequence, policy: str, rng: random.Random):
        if not items:
            raise ValueError("a PD router needs at least one prefill and one decode worker")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.items, self.policy, self._rng = list(items), policy, rng
        self._cycle = itertools.cycle(self.items)

    def pick(self):
        return self._rng.choice(self.items) if self.policy == "random" else next(self._cycle)


def _unreachable(side: str, url: str, err: Exception) -> Response:
    return error_response(502, f"{side} worker {url} failed: {type(err).__name__}: {err}", code=f"{side}_unreachable")


class PDRouter:
    def __init__(self, prefill: Sequence[PrefillWorker], decode: Sequence[str], *, policy: str = "round_robin",
                 api_key: str | None = None, request_timeout_s: float = 1800.0, seed: int | None = None):
        rng = random.Random(seed)
        self.prefill = Picker(prefill, policy, rng)
        self.decode = Picker([u.rstrip("/") for u in decode], policy, rng)
        self.api_key = api_key
        self.request_timeout_s = request_timeout_s  # one deadline for the whole request, streams included
        self.timeout = httpx.Timeout(request_timeout_s, connect=10.0)
        self._client: httpx.AsyncClient | None = None
        self.running = RunningRequests()  # which workers hold each rid, for /abort_request

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:  # made on first use, on the serving loop
            self._client = httpx.AsyncClient(timeout=self.timeout, limits=httpx.Limits(max_connections=None))
        return self._client

    def _headers(self, request: Request) -> dict:
        headers = {}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        if request_id := request.headers.get("x-request-id"):
            headers["X-Request-ID"] = request_id
        return headers

    async def dispatch(self, path: str, body: dict, request: Request) -> Response:
        """Run both legs; a client that disconnects before the answer starts cancels both."""
        work = asyncio.ensure_future(self._dual(path, body, request))
        gone = asyncio.ensure_future(wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if work in done:
                return work.result()
            work.cancel()
            with contextlib.suppress(BaseException):
                await work
            return Response(status_code=499)
        finally:
            gone.cancel()

    async def _dual(self, path: str, body: dict, request: Request) -> Response:
        worker, decode_url = self.prefill.pick(), self.decode.pick()
        if body.get("rid") is None:  # one rid on both workers, so /abort_request can name it (meta_info.id shows it)
            body = {**body, "rid": new_rid()}
        rid = body["rid"]
        release = self.running.add(rid, (worker.url.rstrip("/"), decode_url)) if isinstance(rid, str) else lambda: None
        sent = with_bootstrap(body, worker.url, worker.bootstrap_port, new_room())
        headers = self._headers(request)
        deadline = asyncio.get_running_loop().time() + self.request_timeout_s
        prefill = Leg("prefill", worker.url, self.client, worker.url.rstrip("/") + path, sent, headers, whole=True)
        decode = Leg("decode", decode_url, self.client, decode_url + path, sent, headers, whole=False)
        handed_off = False
        try:
            failed = await both_answered(prefill, decode, deadline, self.request_timeout_s)
            if failed is not None:
                return failed
            merge = path == "/generate" and bool(body.get("return_logprob"))
            p_logprobs = prefill_input_logprobs(prefill.body) if merge else None
            d_resp = decode.response
            media_type = d_resp.headers.get("content-type", "application/json")
            if decode.body is not None:
                return Response(merge_json(decode.body, p_logprobs), status_code=d_resp.status_code,
                                media_type=media_type)
            source = merge_sse(until(d_resp.aiter_lines(), deadline), p_logprobs) if merge else d_resp.aiter_raw()
            handed_off = True
            stream = released(relay(source, d_resp, decode_url, deadline, self.request_timeout_s), release)
            return StreamingResponse(stream, status_code=d_resp.status_code, media_type=media_type)
        finally:
            await prefill.close()
            if not handed_off:
                await decode.close()
                release()

    async def get_first_prefill(self, path: str) -> Response:
        url = self.prefill.items[0].url.rstrip("/") + path
        try:
            resp = await self.client.get(url, headers={"Authorization": f"Bearer {self.api_key}"} if self.api_key
                                         else None, timeout=PROBE_TIMEOUT_S)
        except httpx.HTTPError as err:
            return _unreachable("prefill", url, err)
        return Response(resp.content, status_code=resp.status_code,
                        media_type=resp.headers.get("content-type", "application/json"))

    async def health_generate(self) -> Response:
        """One pair's ``/health_generate``, both at once; 200 only if both are."""
        worker, decode_url = self.prefill.pick(), self.decode.pick()
        urls = [worker.url.rstrip("/") + "/health_generate", decode_url + "/health_generate"]

        async def probe(url: str) -> int | str:
            try:
                return (await self.client.get(url, timeout=PROBE_TIMEOUT_S)).status_code
            except httpx.HTTPError as err:
                return f"{type(err).__name__}: {err}"

        results = await asyncio.gather(*(probe(u) for u in urls))
        healthy = all(isinstance(r, int) and r < 300 for r in results)
        return JSONResponse({"healthy": healthy, "workers": dict(zip(urls, results, strict=True))},
                            status_code=200 if healthy else 503)


def create_router_app(prefill: Sequence[PrefillWorker | tuple[str, int | None] | str], decode: Sequence[str], *,
                      policy: str = "round_robin", api_key: str | None = None, request_timeout_s: float = 1800.0,
                      seed: int | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The router's app. ``prefill``: workers as ``PrefillWorker``, ``(url, bootstrap_port or None)`` or a bare
    URL; ``decode``: URLs. ``api_key``: required from clients and sent to the workers (as sglang-router does).
    ``max_body_bytes``: larger request bodies get 413 before they are read whole (the same default as a worker's)."""
    workers = [w if isinstance(w, PrefillWorker) else PrefillWorker(w, None) if isinstance(w, str)
               else PrefillWorker(w[0], w[1]) for w in prefill]
    pd = PDRouter(workers, decode, policy=policy, api_key=api_key, request_timeout_s=request_timeout_s, seed=seed)
    app = FastAPI(title="fsm-pd router", version="1",
                  description="A PD router: each request goes to one prefill and one decode worker at once.")
    app.state.router = pd
    metrics = RouterMetrics()
    app.state.metrics = metrics
    install_error_handlers(app)

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
        return {"status": "ok", "prefill": len(pd.prefill.items), "decode": len(pd.decode.items)}

    @app.get("/health_generate")
    async def health_generate() -> Response:
        return await pd.health_generate()

    for path in ("/v1/models", "/model_info", "/get_model_info"):
        def proxied(path: str = path):
            async def get() -> Response:
                return await pd.get_first_prefill("/model_info" if path.endswith("model_info") else path)
            get.__name__ = "proxy_" + path.strip("/").replace("/", "_")
            return get
        app.add_api_route(path, proxied(), methods=["GET"])

    async def server_info() -> dict:
        return {"router": "fsm-pd", "policy": policy,
                "prefill": [{"url": w.url, "bootstrap_port": w.bootstrap_port} for w in pd.prefill.items],
                "decode": [{"url": u} for u in pd.decode.items],
                "requests_running": len(pd.running)}  # rids the router is answering (and could abort) now

    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, server_info, methods=["GET"])
    install_router_routes(app, pd, metrics)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)  # added before the key: the key is checked first
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(RouterMetricsMiddleware, metrics=metrics)  # last added runs first: it sees every answer
    return app


def parse_prefill_specs(specs: Sequence[Sequence[str]]) -> list[PrefillWorker]:
    """``--prefill URL [BOOTSTRAP_PORT|none]`` values, as sglang-router reads them."""
    workers = []
    for spec in specs:
        if not 1 <= len(spec) <= 2:
            raise ValueError(f"--prefill takes URL [BOOTSTRAP_PORT], got {' '.join(spec)}")
        port = None
        if len(spec) == 2 and spec[1].lower() != "none":
            try:
                port = int(spec[1])
            except ValueError:
                raise ValueError(f"--prefill {spec[0]}: bootstrap port {spec[1]!r} is not a number or 'none'") from None
        workers.append(PrefillWorker(spec[0], port))
    return workers


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fsm-pd router", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", nargs="+", action="append", required=True, metavar="URL [BOOTSTRAP_PORT]",
                        help="a prefill worker and its bootstrap port ('none' or omitted: decode's default)")
    parser.add_argument("--decode", action="append", required=True, metavar="URL", help="a decode worker")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--policy", choices=POLICIES, default="round_robin")
    parser.add_argument("--api-key", default=os.environ.get("FSM_PD_API_KEY"),
                        help="require 'Authorization: Bearer KEY' (default: $FSM_PD_API_KEY, else none)")
    parser.add_argument("--request-timeout-secs", type=float, default=1800.0)
    parser.add_argument("--pd-disaggregation", action="store_true", help="accepted for sglang-router parity")
    parser.add_argument("--log-level", default="info")
    add_read_timeout_flags(parser)
    return parser


def router_app_from_args(args: argparse.Namespace) -> FastAPI:
    return create_router_app(parse_prefill_specs(args.prefill), args.decode, policy=args.policy,
                             api_key=args.api_key, request_timeout_s=args.request_timeout_secs)


def router_main(argv: Sequence[str] | None = None) -> None:
    from fsm_pd.api.server import serve

    parser = build_arg_parser()
    args = parser.parse_args(argv)
    try:
        app = router_app_from_args(args)
    except ValueError as err:
        parser.error(str(err))
    logging.basicConfig(level=args.log_level.upper())
    serve(app, args.host, args.port, log_level=args.log_level, read_timeouts=read_timeouts_from_args(args))

