"""Graceful drain of a node: SIGTERM or ``POST /drain``, and the node finishes what it holds, then exits 0.

Steps, each logged:

1. *Refuse new work.* The generation routes (``DRAINED_ROUTES``) answer 503 with the reason (code ``draining``),
   so a router retries the request elsewhere; ``GET /health`` answers 503 ``{"status": "draining", ...}``, so a
   router's health check stops sending here. Other routes (info, metrics, tokenize) still answer.
2. *Finish what it holds.* Requests already in (counted from the moment the gate let them through, so a request
   that passed the gate but is not yet submitted counts too) run to their end, streams included, for at most
   ``timeout_s`` (``--drain-timeout-secs``, default 30 s). Progress is logged every few seconds.
3. *Abort the rest* past the bound: each ends with a 503 naming the drain (its room fails with that reason, and
   the peer hears ABORT).
4. *Deregister* from the bootstrap server (a prefill node), so decode nodes stop finding this process.
5. *Stop*: the HTTP server stops; the CLI then closes the engine and its journal and exits 0.

A second SIGTERM, or SIGINT, during a drain exits at once (the journal is still closed). ``fsm_pd_drains_total``
(by trigger), the gauge ``fsm_pd_draining`` and ``fsm_pd_drain_aborted_requests_total`` are on ``/metrics``.

Why at the HTTP layer: what a node "holds" is its open requests, and the gate is where a new one can still be
refused with a status a router understands; the engines need nothing new but an abort that carries a reason.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Gauge

from fsm_pd.api.errors import error_body
from fsm_pd.net.http_protocol import ReadTimeouts
from fsm_pd.net.http_server import _uvicorn_config, run
from fsm_pd.serving.startup import Startup

log = logging.getLogger(__name__)

DRAINED_ROUTES = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})
DEFAULT_DRAIN_TIMEOUT_S = 30.0
ABORT_GRACE_S = 5.0  # after the aborts, how long the aborted requests get to send their error before the stop
PROGRESS_EVERY_S = 5.0
DRAINING_STATUS = 503
STARTING_STATUS = 503


class Drain:
    """The drain of one node's HTTP server. ``live`` is the server's (rid, room) → ``RequestRun`` table
    (``ctx.live``)."""

    def __init__(self, engine: Any, live: dict, *, timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
                 registry: CollectorRegistry | None = None, startup: Startup | None = None):
        if timeout_s < 0:
            raise ValueError(f"the drain timeout must not be negative, got {timeout_s}")
        self.engine, self.live, self.timeout_s = engine, live, timeout_s
        # the node's start-up: the gate refuses requests until it is ready, as it does once the node drains
        self.startup = startup if startup is not None else Startup(ready=True)
        self._cond = threading.Condition()
        self.in_flight = 0  # generation requests past the gate and not yet answered to the end
        self.trigger: str | None = None
        self.started_at: float | None = None
        self.aborted = 0
        self.finished = threading.Event()
        self.on_finished: list[Callable[[], None]] = []  # the server's stop; run once, on the drain's thread
        registry = registry if registry is not None else CollectorRegistry()
        self._drains = Counter("fsm_pd_drains", "Drains begun, by trigger (sigterm, admin)", ["trigger"],
                               registry=registry)
        self._draining = Gauge("fsm_pd_draining", "1 while this node drains", registry=registry)
        self._aborted = Counter("fsm_pd_drain_aborted_requests", "Requests aborted when the drain bound passed",
                                registry=registry)
        self._refused_starting = Counter("fsm_pd_refused_while_starting", "Generation requests refused (503 "
                                         "starting) because the node was not ready yet: 0 behind a router that "
                                         "waits for /health", registry=registry)

    @property
    def draining(self) -> bool:
        return self.trigger is not None

    def status(self) -> dict:
        with self._cond:
            return {"status": "draining", "trigger": self.trigger, "in_flight": self.in_flight,
                    "seconds": round(time.monotonic() - (self.started_at or time.monotonic()), 3),
                    "drain_timeout_secs": self.timeout_s, "finished": self.finished.is_set()}

    def begin(self, trigger: str) -> bool:
        """Start draining (idempotent); True if this call started it. Returns at once: the drain runs on a thread."""
        with self._cond:
            if self.trigger is not None:
                return False
            self.trigger, self.started_at = trigger, time.monotonic()
            held = self.in_flight
        self._drains.labels(trigger).inc()
        self._draining.set(1)
        log.info("drain (%s): refusing new requests with 503; /health answers 503 draining; %d in flight, bound "
                 "%g s (a second SIGTERM or SIGINT exits at once)", trigger, held, self.timeout_s)
        threading.Thread(target=self._run, name="drain", daemon=True).start()
        return True

    # --- the gate (the HTTP server's event loop) ---
    def admit(self) -> bool:
        """Count a generation request in, unless draining (then False: refuse it)."""
        with self._cond:
            if self.trigger is not None:
                return False
            self.in_flight += 1
            return True

    def done(self) -> None:
        with self._cond:
            self.in_flight -= 1
            self._cond.notify_all()
        self.startup.request_done()

    # --- the drain's thread ---
    def _wait_idle(self, until: float, what: str) -> int:
        """Wait until nothing is in flight or ``until`` passes; returns what is still in flight."""
        next_report = time.monotonic() + PROGRESS_EVERY_S
        with self._cond:
            while self.in_flight and (now := time.monotonic()) < until:
                self._cond.wait(min(until, next_report) - now)
                if self.in_flight and time.monotonic() >= next_report:
                    log.info("drain: %d requests still %s, %.0f s left", self.in_flight, what,
                             max(0.0, until - time.monotonic()))
                    next_report += PROGRESS_EVERY_S
            return self.in_flight

    def _run(self) -> None:
        try:
            left = self._wait_idle(self.started_at + self.timeout_s, "running")
            if left:
                self._abort_live()
                left = self._wait_idle(time.monotonic() + ABORT_GRACE_S, "sending their error")
            took = time.monotonic() - self.started_at
            if left:
                log.warning("drain: %d requests still open %.1f s after the drain began; stopping anyway", left, took)
            else:
                log.info("drain: every request answered, %.2f s after the drain began (%d aborted)", took,
                         self.aborted)
            self._deregister()
        except Exception:  # the node must still stop
            log.exception("drain: a step failed; stopping anyway")
        finally:
            self.finished.set()
            for stop in list(self.on_finished):
                try:
                    stop()
                except Exception:
                    log.exception("drain: a stop callback failed")

    def _abort_live(self) -> None:
        reason = (f"aborted: this node is draining (shutting down) and the request did not finish within the "
                  f"drain timeout of {self.timeout_s:g} s; retry it on another node")
        live = list(self.live)
        for rid, room in live:
            try:
                if self.engine.abort(rid, reason=reason, status=DRAINING_STATUS, room=room):
                    self.aborted += 1
                    self._aborted.inc()
            except Exception:
                log.exception("drain: aborting %s failed", rid)
        log.warning("drain: the bound of %g s passed; aborted %d of %d open requests", self.timeout_s, self.aborted,
                    len(live))

    def _deregister(self) -> None:
        deregister = getattr(self.engine, "deregister", None)
        if deregister is None:
            return
        try:
            log.info("drain: %s", deregister())
        except Exception as err:  # a bootstrap server that is gone must not keep the node up
            log.warning("drain: deregistering from the bootstrap server failed: %s: %s", type(err).__name__, err)

    # --- HTTP ---
    def health_answer(self) -> JSONResponse:
        return JSONResponse(self.status(), status_code=DRAINING_STATUS)

    def starting_answer(self) -> JSONResponse:
        """``/health`` (and a refused request) while the node starts: 503 with how far it got."""
        return JSONResponse(self.startup.status(), status_code=STARTING_STATUS, headers={"Retry-After": "1"})

    def not_ready_refusal(self) -> JSONResponse:
        self._refused_starting.inc()
        status = self.startup.status()
        progress = status.get("progress") or {}
        where = f"; {progress['done']} of {progress['total']} programs ready" if progress else ""
        return JSONResponse(error_body(STARTING_STATUS, f"this node is starting ({status.get('phase', 'starting')}"
                                                        f"{where}) and takes no requests yet; send it to another "
                                                        "node or retry", "starting"),
                            status_code=STARTING_STATUS, headers={"Retry-After": "1"})

    def refusal(self) -> JSONResponse:
        return JSONResponse(error_body(DRAINING_STATUS, "this node is draining (shutting down) and takes no new "
                                                        "requests; send it to another node", "draining"),
                            status_code=DRAINING_STATUS, headers={"Retry-After": "1"})

    def routes(self) -> APIRouter:
        router = APIRouter(tags=["admin"])

        @router.post("/drain", status_code=202)
        async def drain() -> Response:
            """Drain this node: refuse new requests, finish the open ones (``--drain-timeout-secs``), deregister,
            exit 0. Idempotent; 202 with the drain's status."""
            self.begin("admin")
            return JSONResponse(self.status(), status_code=202)

        return router


class DrainGate:
    """Pure ASGI: counts the generation requests in and out, and refuses them with 503 until the node is ready and
    once it drains."""

    def __init__(self, app, drain: Drain):
        self.app, self.drain = app, drain

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") not in DRAINED_ROUTES:
            await self.app(scope, receive, send)
            return
        if not self.drain.startup.ready:
            await self.drain.not_ready_refusal()(scope, receive, send)
            return
        if not self.drain.admit():
            await self.drain.refusal()(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.done()


class DrainingServer(uvicorn.Server):
    """uvicorn with the drain on SIGTERM: the first SIGTERM drains (the server stops when the drain ends); a second
    SIGTERM, or SIGINT during a drain, exits at once. SIGINT otherwise stops as uvicorn does."""

    def __init__(self, config: uvicorn.Config, drain: Drain):
        super().__init__(config)
        self.drain = drain
        drain.on_finished.append(self._drained)

    def _drained(self) -> None:
        log.info("drain: stopping the HTTP server")
        self.should_exit = True

    def handle_exit(self, sig: int, frame) -> None:  # the main thread, between two bytecodes of the event loop
        name = signal.Signals(sig).name
        if sig == signal.SIGTERM and not self.drain.draining and not self.should_exit:
            log.info("%s: draining this node", name)
            self.drain.begin("sigterm")
            return
        if self.drain.draining or self.should_exit:
            log.warning("%s again: exiting at once without waiting for open requests", name)
            self.force_exit = True
        self.should_exit = True


def serve_draining(app, host: str, port: int, *, log_level: str = "info",
                   read_timeouts: ReadTimeouts | None = None, uds: str | None = None) -> None:
    """Serve a node's ``app`` (``create_app``: it holds its ``Drain`` as ``app.state.drain``) on ``host:port`` or
    the unix socket ``uds`` until it has drained (SIGTERM, ``POST /drain``) or is stopped (SIGINT)."""
    config = _uvicorn_config(app, log_level, read_timeouts, timeout_graceful_shutdown=ABORT_GRACE_S)
    run(DrainingServer(config, app.state.drain), host, port, uds)
