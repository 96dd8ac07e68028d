"""``/metrics``: the engine's Prometheus registries and the API's own request counters, in one text exposition.

Each app gets its own ``CollectorRegistry`` (not the process-global one), so several servers in one process (tests,
``fsm-pd launch``) do not collide on metric names.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

# Routes counted by name; anything else is "other", so a scanner probing random paths cannot grow the label set.
CLIENT_CLOSED = 499  # nginx's "client closed request": what a request whose client left before its end is counted as

COUNTED_ROUTES = frozenset({
    "/generate", "/v1/completions", "/v1/chat/completions", "/v1/models", "/abort_request", "/health",
    "/health_generate", "/server_info", "/get_server_info", "/model_info", "/get_model_info", "/metrics",
    "/flush_cache", "/tokenize", "/detokenize", "/v1/tokenize", "/v1/detokenize", "/get_load",
})


class ApiMetrics:
    def __init__(self, registries: Iterable[CollectorRegistry] = ()):
        self.registry = CollectorRegistry(auto_describe=True)
        self.others = [r for r in registries if r is not None]
        self.requests = Counter("fsm_pd_http_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=self.registry)
        self.seconds = Histogram("fsm_pd_http_request_seconds", "Time to the response's headers, by route",
                                 ["route"], registry=self.registry,
                                 buckets=(0.005, 0.02, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300))

    def render(self) -> tuple[bytes, str]:
        return b"".join(generate_latest(r) for r in [*self.others, self.registry]), CONTENT_TYPE_LATEST


class MetricsMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware, which would hide the client's disconnect from the handlers).

    A request is counted under the status it answered, except that one whose client disconnected before the
    response ended (a stream cut short: its 200 was already sent) is counted as 499."""

    def __init__(self, app, metrics: ApiMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope.get("path", "")
        route = route if route in COUNTED_ROUTES else "other"
        started = time.monotonic()
        status = {"code": 500, "complete": False, "client_gone": False}

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                self.metrics.seconds.labels(route).observe(time.monotonic() - started)
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                status["complete"] = True
            await send(message)

        async def watching_receive():
            message = await receive()
            if message["type"] == "http.disconnect" and not status["complete"]:
                status["client_gone"] = True  # a stream's 200 went out, but the client left before its end
            return message

        try:
            await self.app(scope, watching_receive, counting_send)
        finally:
            code = CLIENT_CLOSED if status["client_gone"] else status["code"]
            self.metrics.requests.labels(route, str(code)).inc()
