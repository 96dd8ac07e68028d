"""``/metrics``: the engine's Prometheus registries and the API's own request counters, in one text exposition.

Each app gets its own ``CollectorRegistry`` (not the process-global one), so several servers in one process (tests,
``fsm-pd launch``) do not collide on metric names.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from fsm_pd.model.compiles import CompileCollector

# Routes counted by name; anything else is "other", so a scanner probing random paths cannot grow the label set.
CLIENT_CLOSED = 499  # nginx's "client closed request": what a request whose client left before its end is counted as

COUNTED_ROUTES = frozenset({
    "/generate", "/v1/completions", "/v1/chat/completions", "/v1/models", "/abort_request", "/health",
    "/health_generate", "/server_info", "/get_server_info", "/model_info", "/get_model_info", "/metrics",
    "/flush_cache", "/tokenize", "/detokenize", "/v1/tokenize", "/v1/detokenize", "/get_load",
})


class ResponseWatch:
    """Wraps an ASGI request's ``receive`` and ``send`` to see how its response went: the status, when the headers
    left, and whether the client left before the body ended (a stream cut short: its 200 was already sent)."""

    def __init__(self, receive, send):
        self._receive, self._send = receive, send
        self.code, self.complete, self.client_gone = 500, False, False
        self.headers_at: float | None = None

    async def send(self, message) -> None:
        if message["type"] == "http.response.start":
            self.code, self.headers_at = message["status"], time.monotonic()
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True
        await self._send(message)

    async def receive(self):
        message = await self._receive()
        if message["type"] == "http.disconnect" and not self.complete:
            self.client_gone = True
        return message

    @property
    def counted_code(self) -> int:
        """The status to count: the one answered, or 499 when the client left before the response ended."""
        return CLIENT_CLOSED if self.client_gone else self.code


class ApiMetrics:
    def __init__(self, registries: Iterable[CollectorRegistry] = ()):
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(CompileCollector())
        self.others = [r for r in registries if r is not None]
        self.requests = Counter("fsm_pd_http_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=self.registry)
        self.seconds = Histogram("fsm_pd_http_request_seconds", "Time to the response's headers, by route",
                                 ["route"], registry=self.registry,
                                 buckets=(0.005, 0.02, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300))
        # a request handler's wait on its engine that passed its deadline (api/runner.py): first_token, token_idle;
        # a room's state deadlines are counted as fsm_pd_failures{reason="<timer> timeout"}
        self.deadline_expiries = Counter("fsm_pd_request_deadline_expiries", "Requests ended because the engine "
                                         "sent no output within a deadline, by deadline (first_token, token_idle)",
                                         ["deadline"], registry=self.registry)
        for name in ("first_token", "token_idle"):  # at 0 from the first scrape, so rates work before the first
            self.deadline_expiries.labels(name)

    def render(self) -> tuple[bytes, str]:
        return b"".join(generate_latest(r) for r in [*self.others, self.registry]), CONTENT_TYPE_LATEST


class WatchedMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware, which would hide the client's disconnect from the handlers): every HTTP
    request runs under a ``ResponseWatch``; ``began`` before the app sees it, ``ended`` once it ended, however."""

    def __init__(self, app, metrics):
        self.app = app
        self.metrics = metrics

    def label(self, path: str) -> str:
        raise NotImplementedError

    def began(self, route: str) -> None:
        pass

    def ended(self, route: str, started: float, watch: ResponseWatch) -> None:
        raise NotImplementedError

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = self.label(scope.get("path", ""))
        started = time.monotonic()
        watch = ResponseWatch(receive, send)
        self.began(route)
        try:
            await self.app(scope, watch.receive, watch.send)
        finally:
            self.ended(route, started, watch)


class MetricsMiddleware(WatchedMiddleware):
    """A request is counted under the status it answered, except that one whose client disconnected before the
    response ended (a stream cut short: its 200 was already sent) is counted as 499."""

    metrics: ApiMetrics

    def label(self, path: str) -> str:
        return path if path in COUNTED_ROUTES else "other"

    def ended(self, route: str, started: float, watch: ResponseWatch) -> None:
        if watch.headers_at is not None:
            self.metrics.seconds.labels(route).observe(watch.headers_at - started)
        self.metrics.requests.labels(route, str(watch.counted_code)).inc()
