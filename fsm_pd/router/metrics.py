"""The built-in router's own Prometheus metrics (``GET /metrics`` on the router): requests by route and status, errors,
latency to the end of the answer (a stream's last byte, not its headers), requests in flight, and the fleet's retries,
migrations, refusals to retry, ejections and re-admissions.

A request whose client left before its answer ended is counted as 499 (nginx's "client closed request") and as an
error of kind ``client_closed``; 4xx answers are ``client`` errors and 5xx ``upstream`` ones (the router's own 5xx
are about a worker: unreachable, failed, too slow).
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from fsm_pd.api.metrics import CLIENT_CLOSED, ResponseWatch, WatchedMiddleware

ROUTER_ROUTES = frozenset({
    "/generate", "/v1/completions", "/v1/chat/completions", "/v1/models", "/abort_request", "/flush_cache",
    "/tokenize", "/detokenize", "/v1/tokenize", "/v1/detokenize", "/get_load", "/health", "/health_generate",
    "/server_info", "/get_server_info", "/model_info", "/get_model_info", "/metrics",
})


def route_label(path: str) -> str:
    if path in ROUTER_ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{id}"  # one label for every model id: a client cannot grow the label set
    return "other"


def error_kind(status: int) -> str | None:
    if status == CLIENT_CLOSED:
        return "client_closed"
    if status >= 500:
        return "upstream"
    if status >= 400:
        return "client"
    return None


class RouterMetrics:
    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("fsm_pd_router_requests", "Requests answered by the router, by route and status",
                                ["route", "status"], registry=self.registry)
        self.errors = Counter("fsm_pd_router_errors", "Requests that ended in an error, by route and kind "
                              "(client: 4xx, upstream: 5xx, client_closed: the client left first)",
                              ["route", "kind"], registry=self.registry)
        self.seconds = Histogram("fsm_pd_router_request_seconds", "Time from a request's arrival to the end of "
                                 "its answer (streams included), by route", ["route"], registry=self.registry,
                                 buckets=(0.005, 0.02, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800))
        self.in_flight = Gauge("fsm_pd_router_requests_in_flight", "Requests the router is answering now, by route",
                               ["route"], registry=self.registry)
        # the fleet (docs/fleet.md): reason labels are "{side}_unreachable", "{side}_{status}", ... (a bounded set)
        self.retries = Counter("fsm_pd_router_retries", "Attempts started again on another pair before the answer "
                               "started, by the failure that caused them", ["reason"], registry=self.registry)
        self.migrations = Counter("fsm_pd_router_migrations", "Requests moved to another decode after theirs failed "
                                  "(a broken stream, or a whole answer lost after the prefill), by reason", ["reason"],
                                  registry=self.registry)
        self.gave_up = Counter("fsm_pd_router_failover_refused", "Failures not tried again: retries_exhausted, "
                               "retry_budget (the router-wide budget was spent), no_prefill / no_decode (every "
                               "worker of the role ejected)", ["reason"], registry=self.registry)
        self.ejections = Counter("fsm_pd_router_worker_ejections", "Workers the circuit breaker ejected, by role and "
                                 "reason (requests, health_check, draining)", ["role", "reason"],
                                 registry=self.registry)
        self.readmissions = Counter("fsm_pd_router_worker_readmissions", "Ejected workers re-admitted after their "
                                    "cool-down and a good health check", ["role"], registry=self.registry)
        self.admitted = Gauge("fsm_pd_router_workers_admitted", "Workers requests may be sent to now, by role",
                              ["role"], registry=self.registry)
        self.outstanding = Gauge("fsm_pd_router_worker_outstanding", "Requests in flight from this router, by worker",
                                 ["role", "url"], registry=self.registry)
        # a wait that passed its deadline (legs.RouterDeadlines): request, prefill_leg, decode_leg, stream_idle
        self.deadline_expiries = Counter("fsm_pd_router_deadline_expiries", "Waits on a worker that passed their "
                                         "deadline, by deadline (request, prefill_leg, decode_leg, stream_idle)",
                                         ["deadline"], registry=self.registry)
        for name in ("request", "prefill_leg", "decode_leg", "stream_idle"):  # at 0 from the first scrape
            self.deadline_expiries.labels(name)
        # selective disaggregation (router/policy.py): the path of each attempt, and the idle-prefill alarm
        self.routed = Counter("fsm_pd_router_routed", "Attempts by path: pd (through a prefill node) or local (the "
                              "decode node prefilled the prompt itself)", ["path"], registry=self.registry)
        self.prefill_idle_alarm = Gauge("fsm_pd_router_prefill_idle_alarm", "1 when no prefill node completed any "
                                        "of the last requests answered although the policy is always or some of "
                                        "them had long prompts (router/policy.py, PrefillIdleWatch)",
                                        registry=self.registry)
        self.idle_watch = None  # the router's PrefillIdleWatch, read at every scrape
        self._fleet = None

    def deadline_expired(self, name: str) -> None:
        self.deadline_expiries.labels(name).inc()

    def fleet_event(self, event: str, role: str, reason: str) -> None:
        if event == "ejected":
            self.ejections.labels(role, reason).inc()
        else:
            self.readmissions.labels(role).inc()

    def watch(self, fleet) -> None:
        """Read the fleet's gauges at every scrape."""
        self._fleet = fleet

    def render(self) -> tuple[bytes, str]:
        if self.idle_watch is not None:
            self.prefill_idle_alarm.set(1 if self.idle_watch.alarm else 0)
        if self._fleet is not None:
            for role, workers in self._fleet.workers.items():
                self.admitted.labels(role).set(sum(w.admitted for w in workers))
                for w in workers:
                    self.outstanding.labels(role, w.url).set(w.outstanding)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RouterMetricsMiddleware(WatchedMiddleware):
    """Outermost: every request is counted, those the API key or the body limit refused included."""

    metrics: RouterMetrics

    def label(self, path: str) -> str:
        return route_label(path)

    def began(self, route: str) -> None:
        self.metrics.in_flight.labels(route).inc()

    def ended(self, route: str, started: float, watch: ResponseWatch) -> None:
        self.metrics.in_flight.labels(route).dec()
        code = watch.counted_code
        self.metrics.requests.labels(route, str(code)).inc()
        self.metrics.seconds.labels(route).observe(time.monotonic() - started)
        if (kind := error_kind(code)) is not None:
            self.metrics.errors.labels(route, kind).inc()
