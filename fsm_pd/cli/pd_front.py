"""The public face of ``fsm-pd serve --role pd``: its app behind the process's start-up, health and drain.

A node puts its engine behind a gate (``api/drain.py``); this puts the process's app (a node's app over both engines,
``pd_pair.py``, or the built-in router) and so both engines behind the same rules, for the one process:

- ``/health`` answers 503 ``starting`` (with each engine's phase and progress) until both engines can serve, and 503
  once either has died (its model thread or its KV manager's loop). ``/livez`` (and the router's ``/liveness``) is
  503 once an engine died: a restart is the cure. ``/startupz`` is 503 until ready. ``/readiness`` is 503 while
  starting, draining or dead, else the app's own answer.
- A generation request that arrives while the process starts waits for readiness, at most ``--startup-wait-secs``,
  and is then served (on a TPU a cold start compiles for a minute or more; a request sent the moment the socket
  accepts must not be lost).
- SIGTERM or ``POST /drain`` drains: new requests get 503 ``draining``, the open ones finish within
  ``--drain-timeout-secs`` (then they are aborted in both engines), and the process exits 0 (``Drain``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from typing import Any

from fastapi.responses import JSONResponse

from fsm_pd.api.drain import DRAINED_ROUTES, Drain, DrainGate
from fsm_pd.api.errors import error_body
from fsm_pd.serving.startup import Startup

WAIT_POLL_S = 0.05
UNHEALTHY_STATUS = 503


class BothEngines:
    """What a ``Drain`` asks of "the engine", for two: abort in both, deregister the prefill engine, and the live
    requests of both (``(rid, None)``: every attempt of the rid)."""

    def __init__(self, engines: Sequence[Any]) -> None:
        self.engines = engines

    def abort(self, rid: str, reason: str | None = None, status: int = 503, room: int | None = None) -> bool:
        return any([engine.abort(rid, reason=reason, status=status) for engine in self.engines])

    def deregister(self) -> str:
        return self.engines[0].deregister()

    def __iter__(self) -> Iterator[tuple[str, None]]:
        rids = {seq.rid for engine in self.engines for seq in engine.requests.live()}
        return iter([(rid, None) for rid in sorted(rids)])


class PDFront:
    """Pure ASGI around the process's app (module doc)."""

    def __init__(self, app: Any, engines: Sequence[Any], startups: Sequence[Startup], *, drain_timeout_s: float,
                 startup_wait_s: float, registry: Any = None) -> None:
        self.app, self.engines, self.startups = app, list(engines), list(startups)
        self.startup_wait_s = startup_wait_s
        both = BothEngines(self.engines)
        # the drain's "startup" is the prefill engine's: both are marked ready together (serve.prepare_programs)
        self.drain = Drain(both, both, timeout_s=drain_timeout_s, registry=registry, startup=self.startups[0])
        self.gate = DrainGate(app, self.drain)

    # --- what the process is ---
    @property
    def ready(self) -> bool:
        return all(s.ready for s in self.startups)

    def dead(self) -> str | None:
        """Why the process cannot serve any more (an engine died, or its start-up failed), or None."""
        for engine, startup in zip(self.engines, self.startups, strict=True):
            if startup.failed:
                return f"the {engine.role} engine's start-up failed: {startup.failed}"
            if (reason := engine.health()) is not None:
                return f"the {engine.role} engine cannot serve: {reason}"
        return None

    def starting(self) -> JSONResponse:
        status = {"status": "starting",
                  "engines": {engine.role: s.status() for engine, s in zip(self.engines, self.startups, strict=True)}}
        return JSONResponse(status, status_code=503, headers={"Retry-After": "1"})

    @staticmethod
    def unhealthy(reason: str) -> JSONResponse:
        return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=UNHEALTHY_STATUS)

    # --- ASGI ---
    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        answer = await self._answer(scope.get("path", ""), scope.get("method", "GET"))
        if answer is not None:
            await answer(scope, receive, send)
            return
        await self.gate(scope, receive, send)  # a node's: counts requests in and out, refuses them while draining

    async def _answer(self, path: str, method: str) -> Any:
        """This gate's own answer to a request, or None to let the app answer it."""
        if path in ("/livez", "/liveness"):
            reason = self.dead()
            return self.unhealthy(reason) if reason else JSONResponse({"status": "alive"})
        if path == "/startupz":
            return JSONResponse({"status": "started"}) if self.ready else self.starting()
        if path == "/drain" and method == "POST":
            self.drain.begin("admin")
            return JSONResponse(self.drain.status(), status_code=202)
        if path in ("/health", "/readiness", "/health_generate"):
            if (reason := self.dead()) is not None:
                return self.unhealthy(reason)
            if not self.ready:
                return self.starting()
            return self.drain.health_answer() if self.drain.draining else None
        if path in DRAINED_ROUTES:
            if not await self._wait_ready():
                return self._not_ready()
            if (reason := self.dead()) is not None:
                return JSONResponse(error_body(UNHEALTHY_STATUS, reason, "unhealthy"), status_code=UNHEALTHY_STATUS)
        return None

    async def _wait_ready(self) -> bool:
        """Hold a request that came while starting until both engines are ready (at most ``startup_wait_s``)."""
        deadline = time.monotonic() + self.startup_wait_s
        while not self.ready and self.dead() is None and time.monotonic() < deadline:
            await asyncio.sleep(WAIT_POLL_S)
        return self.ready

    def _not_ready(self) -> JSONResponse:
        reason = self.dead()
        if reason is not None:
            return JSONResponse(error_body(UNHEALTHY_STATUS, reason, "unhealthy"), status_code=UNHEALTHY_STATUS)
        return JSONResponse(error_body(503, f"this process is still starting after {self.startup_wait_s:g} s "
                                            "(--startup-wait-secs); retry", "starting"),
                            status_code=503, headers={"Retry-After": "1"})
