"""The bootstrap server: where prefill ranks register and decode nodes find them, wire-compatible with SGLang.

``create_bootstrap_app`` builds the FastAPI app (routes below); ``BootstrapServer`` serves it with uvicorn on a
background thread. Routes, as SGLang's ``CommonKVBootstrapServer`` has them (texts and status codes included):

* ``PUT /route``: a prefill rank registers (``RankRegistration``) → ``200 OK``.
* ``GET /route?prefill_dp_rank=&prefill_cp_rank=&target_tp_rank=&target_pp_rank=``: all four -1 → the layout
  (``SERVER_INFO_KEYS``); otherwise that rank's ``{rank_ip, rank_port}`` plus fsm-pd's extras. 503 until every
  rank registered, 404 for a rank not registered, 400 for a parameter absent or not an integer.
* ``POST /register_dp_rank`` ``{bootstrap_room, dp_rank}`` → ``200 OK``; ``POST /query_dp_ranks``
  ``{bootstrap_rooms: [...]}`` → ``{"<room>": dp_rank}`` for the rooms known.
* ``GET /health`` → ``200 OK``.
* *fsm-pd:* ``POST /deregister`` with a rank's registration body → ``200 OK`` once that rank is out (a prefill node
  draining), ``404`` if it is not registered, ``409`` if another instance holds it now (left in place).

What fsm-pd adds without changing what an SGLang client sees: checked bodies (400 with the reason, never a 500 for
what a client sent), a body size limit (413), a layout conflict check (409), and an optional shared token on the
two writes (401 without ``Authorization: Bearer <token>``). Reads stay open because SGLang's decode sends no token.
"""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from fsm_pd.bootstrap.registry import PrefillRegistry, RegistrationConflict
from fsm_pd.bootstrap.wire import (
    BadRequest,
    RankRegistration,
    parse_dp_rank_query,
    parse_dp_rank_registration,
    parse_route_query,
)
from fsm_pd.net.body_limit import BodySizeLimit
from fsm_pd.net.http_server import AppServer

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 256 * 1024  # a registration with a KV layout is ~1 KiB; 256 KiB holds ~12k rooms per query


def create_bootstrap_app(*, expected_ranks: int | None = None, token: str | None = None,
                         entry_ttl_s: float = 120.0, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                         registry: PrefillRegistry | None = None) -> FastAPI:
    """The bootstrap server's app. ``expected_ranks``, when given, is how many prefill ranks the operator expects
    (a registration describing another count is refused with 409); otherwise the first registration's layout says.
    ``token`` guards ``PUT /route`` and ``POST /register_dp_rank``. ``registry`` lets a caller share its own."""
    if token is not None and not token:
        raise ValueError("token must be a non-empty string, or None for no token")
    registry = registry or PrefillRegistry(expected_ranks=expected_ranks, entry_ttl_s=entry_ttl_s)
    app = FastAPI(title="fsm-pd bootstrap", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.registry = registry
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes, flag="--max-body-bytes")
    expected_auth = None if token is None else f"Bearer {token}".encode()

    def refused(request: Request) -> Response | None:
        if expected_auth is None:
            return None
        given = request.headers.get("authorization", "").encode()
        if hmac.compare_digest(given, expected_auth):
            return None
        reason = "missing" if not given else "wrong"
        return PlainTextResponse(f"Unauthorized: {reason} bearer token for a write to the bootstrap server.",
                                 status_code=401, headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, exc: BadRequest) -> Response:
        return PlainTextResponse(str(exc), status_code=400)

    @app.exception_handler(RegistrationConflict)
    async def conflict(request: Request, exc: RegistrationConflict) -> Response:
        log.warning("refused a prefill registration: %s", exc)
        return PlainTextResponse(str(exc), status_code=409)

    # One route for both methods, as SGLang has it, so that a 405 on /route lists both in its Allow header.
    @app.api_route("/route", methods=["GET", "PUT"])
    async def route(request: Request) -> Response:
        return await (register_rank(request) if request.method == "PUT" else lookup(request))

    async def register_rank(request: Request) -> Response:
        if (denied := refused(request)) is not None:
            return denied
        reg = RankRegistration.from_json(await _json_body(request))
        count = registry.register(reg)
        log.info("registered prefill rank dp=%d cp=%d tp=%d pp=%d at %s:%d (%d/%s)", *reg.key, reg.rank_ip,
                 reg.rank_port, count, registry.expected_count)
        return PlainTextResponse("OK")

    async def lookup(request: Request) -> Response:
        dp, cp, tp, pp = parse_route_query(request.query_params)
        if not registry.is_ready():
            return PlainTextResponse(f"Prefill server not fully registered yet "
                                     f"({registry.registered_count} workers registered).", status_code=503)
        if (dp, cp, tp, pp) == (-1, -1, -1, -1):
            return JSONResponse(registry.server_info())
        info = registry.lookup(dp, cp, tp, pp)
        if info is None:
            return PlainTextResponse(f"Bootstrap info not found for dp_rank={dp} cp_rank={cp} tp_rank={tp} "
                                     f"pp_rank={pp}", status_code=404)
        return JSONResponse(info)

    @app.post("/deregister")
    async def deregister(request: Request) -> Response:
        if (denied := refused(request)) is not None:
            return denied
        reg = RankRegistration.from_json(await _json_body(request))
        outcome = registry.deregister(reg)
        if outcome == "removed":
            return PlainTextResponse("OK")
        if outcome == "absent":
            return PlainTextResponse(f"No prefill rank dp={reg.key[0]} cp={reg.key[1]} tp={reg.key[2]} "
                                     f"pp={reg.key[3]} is registered.", status_code=404)
        return PlainTextResponse(f"Prefill rank dp={reg.key[0]} cp={reg.key[1]} tp={reg.key[2]} pp={reg.key[3]} "
                                 f"is registered by another instance than {reg.instance}; left in place.",
                                 status_code=409)

    @app.post("/register_dp_rank")
    async def register_dp_rank(request: Request) -> Response:
        if (denied := refused(request)) is not None:
            return denied
        room, dp_rank = parse_dp_rank_registration(await _json_body(request))
        registry.register_room(room, dp_rank)
        return PlainTextResponse("OK")

    @app.post("/query_dp_ranks")
    async def query_dp_ranks(request: Request) -> Response:
        return JSONResponse(registry.query_rooms(parse_dp_rank_query(await _json_body(request))))

    @app.get("/health")
    async def health() -> Response:
        return PlainTextResponse("OK")

    return app


async def _json_body(request: Request) -> Any:
    body = await request.body()
    if not body:
        raise BadRequest("the request has no body; a JSON object is expected")
    try:
        return json.loads(body)
    except RecursionError:
        raise BadRequest("the body's JSON is nested too deeply") from None
    except ValueError as exc:  # not UTF-8, not JSON, or an integer past Python's digit limit
        raise BadRequest(f"the body is not valid JSON: {exc}") from None


class BootstrapServer(AppServer):
    """Serves ``create_bootstrap_app`` on ``host:port`` from a daemon thread; ``port=0`` picks a free port. With
    ``uds``, on that unix socket instead (``url`` is then ``unix:PATH``).

    The socket is bound in ``start()``, before the thread starts, so ``.port`` is known (and a busy port fails
    there, not in the thread)."""

    name = "bootstrap server"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, expected_ranks: int | None = None,
                 token: str | None = None, entry_ttl_s: float = 120.0,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, registry: PrefillRegistry | None = None,
                 uds: str | None = None):
        app = create_bootstrap_app(expected_ranks=expected_ranks, token=token, entry_ttl_s=entry_ttl_s,
                                   max_body_bytes=max_body_bytes, registry=registry)
        # keep-alive 30 s and a concurrency cap: decode nodes poll /health; SGLang logs these at debug only too
        super().__init__(app, host, port, uds=uds, timeout_keep_alive=30, limit_concurrency=1024)
        self.registry: PrefillRegistry = app.state.registry

    def start(self, timeout_s: float = 10.0) -> BootstrapServer:
        super().start(timeout_s)
        log.info("bootstrap server listening on %s", self.url)
        return self
