"""The built-in router's request path: attempts until one starts its answer (each on a pair the fleet picked, or
on one node when the policy sends the request local: ``attempts.py``), retries of a failed attempt before the answer
starts (on another pair, within the request's tries and the router's retry budget), and the migration of a stream
whose decode broke off (``migrate.py``). ``app.py`` builds the app and reads the flags; ``fleet.py`` holds the health
checks, breakers, selection and budget; ``policy.py`` which path a request takes; ``legs.py`` the legs of an
attempt; ``merge.py`` what is added to and merged from the workers' bodies.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fsm_pd.api.errors import error_body, error_response, with_rid
from fsm_pd.api.requests import new_rid
from fsm_pd.api.runner import wait_disconnect
from fsm_pd.api.streaming import PROGRESS_HEADER, RECOMPUTED_HEADER, ROUTE_HEADERS
from fsm_pd.api.tasks import LEFT, cancel_and_wait, unless_left
from fsm_pd.net.asgi_transport import PASS_TO
from fsm_pd.net.unix_http import async_client, http_url
from fsm_pd.router.attempts import Attempts, Failure, Started, error_message, needs_prefill_body
from fsm_pd.router.cache_aware import CacheAwareSettings, routing_key
from fsm_pd.router.fleet import BreakerSettings, Fleet, HealthChecker, Worker
from fsm_pd.router.legs import (
    DEFAULT_DEADLINES,
    DONE,
    RouterDeadlines,
    StreamIdle,
    WorkerLost,
    idle_message,
    relay,
    until,
)
from fsm_pd.router.merge import check_bootstrap, merge_json, merge_sse, prefill_input_logprobs
from fsm_pd.router.metrics import RouterMetrics
from fsm_pd.router.migrate import Progress, can_migrate, node_failure
from fsm_pd.router.passthrough import PassThrough
from fsm_pd.router.policy import PolicySettings, PrefillIdleWatch, Route, RouteInput, decide, prompt_tokens
from fsm_pd.router.retries import DEFAULT_RETRY, RETRY_POLICIES, RetryBudget, RetrySettings, Tries, retry_backoff
from fsm_pd.router.routes import RunningRequests

log = logging.getLogger(__name__)

GENERATION_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
PROBE_TIMEOUT_S = 45.0  # health and info probes; longer than a worker's own /health_generate limit (30 s)
DEFAULT_STARTUP_WAIT_S = 60.0  # a request that finds every worker of a role starting waits this long for one


@dataclass(frozen=True, slots=True)
class PrefillWorker:
    url: str
    bootstrap_port: int | str | None  # None: decode uses its own default (SGLang's "null"); "unix:PATH": a socket


DEFAULT_BREAKER = BreakerSettings()


def _unreachable(side: str, url: str, err: Exception) -> Response:
    return error_response(502, f"{side} worker {url} failed: {type(err).__name__}: {err}", code=f"{side}_unreachable")


class PDRouter:
    def __init__(self, prefill: Sequence[PrefillWorker], decode: Sequence[str], *, policy: str = "least_outstanding",
                 api_key: str | None = None, request_timeout_s: float = 1800.0, seed: int | None = None,
                 retry: RetrySettings = DEFAULT_RETRY, breaker: BreakerSettings = DEFAULT_BREAKER,
                 health_interval_s: float = 5.0, health_timeout_s: float = 5.0, metrics: RouterMetrics | None = None,
                 cache_aware: CacheAwareSettings | None = None, deadlines: RouterDeadlines = DEFAULT_DEADLINES,
                 pd_policy: PolicySettings | None = None, startup_wait_s: float = DEFAULT_STARTUP_WAIT_S,
                 local_apps: dict[str, Any] | None = None):
        if retry.policy not in RETRY_POLICIES:
            raise ValueError(f"retry policy must be one of {RETRY_POLICIES}, got {retry.policy!r}")
        if retry.max_retries < 0 or health_interval_s <= 0 or health_timeout_s <= 0:
            raise ValueError("--max-retries must not be negative, health-check interval and timeout positive")
        for w in prefill:
            check_bootstrap(w.url, w.bootstrap_port)
        if startup_wait_s < 0:
            raise ValueError(f"--worker-startup-wait-secs must not be negative, got {startup_wait_s}")
        self.startup_wait_s = startup_wait_s  # how long a request waits for a worker that is still starting
        self.metrics = metrics or RouterMetrics()
        # a worker on a unix socket (unix:PATH) is reached at http+unix://localhost/PATH (unix_http.http_url)
        self.fleet = Fleet([Worker("prefill", http_url(w.url).rstrip("/"), w.bootstrap_port) for w in prefill],
                           [Worker("decode", http_url(u).rstrip("/")) for u in decode], policy=policy, breaker=breaker,
                           rng=random.Random(seed), observer=self.metrics.fleet_event, cache_aware=cache_aware)
        self.metrics.watch(self.fleet)
        self.pd_policy = pd_policy or PolicySettings()  # which requests go through a prefill node (policy.py)
        self.idle_watch = self.metrics.idle_watch = PrefillIdleWatch(self.pd_policy)
        self.retry = retry
        self.budget = RetryBudget(retry.budget_ratio, retry.budget_min_per_s, retry.budget_window_s)
        self.api_key = api_key
        self.request_timeout_s = request_timeout_s  # one deadline for the whole request, streams included
        self.deadlines = deadlines  # each leg's, and a stream's between chunks (legs.RouterDeadlines)
        self.timeout = httpx.Timeout(request_timeout_s, connect=10.0)
        self._client: httpx.AsyncClient | None = None
        self.local_apps = local_apps  # {unix socket path: its worker's app in this process}: called directly
        self.running = RunningRequests()  # which workers hold each rid, for /abort_request
        auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.health = HealthChecker(self.fleet, health_interval_s, health_timeout_s, auth)
        self._health_task: asyncio.Task | None = None
        self.attempts = Attempts(lambda: self.client, self.fleet, self.metrics, self.running, deadlines, api_key,
                                 request_timeout_s)

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:  # made on first use, on the serving loop
            self._client = async_client(self.local_apps, timeout=self.timeout,
                                        limits=httpx.Limits(max_connections=None))
        return self._client

    async def aclose(self) -> None:
        """Stop what runs beside the requests: the health checks and the prefill answers still awaited, then close
        the client (the router app's shutdown calls this)."""
        tasks = [t for t in (self._health_task, *self.attempts.finishing) if t is not None and not t.done()]
        await cancel_and_wait(*tasks, what="the router's background tasks")
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def ensure_health_checks(self) -> None:
        """Start the health checks on the serving loop, once (the first request or ``/health`` calls this); again if
        they died."""
        if self._health_task is None or self._health_task.done():
            self._health_task = asyncio.ensure_future(self.health.run(self.client))

    async def first_checks(self) -> None:
        """Start the health checks, and wait (within a check's timeout) for their first round: until then no worker
        is known to be ready, and one may still be starting."""
        self.ensure_health_checks()
        if not self.health.checked.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.health.checked.wait(), self.health.timeout_s + 1)

    def readiness(self) -> tuple[bool, dict]:
        """Whether a request can be served now: a decode worker whose health check passed, and a prefill worker too
        when the policy sends every request through one (``always``); with ``auto`` a decode worker serves alone.
        The body says what is missing, per worker."""
        needed = ("prefill", "decode") if self.pd_policy.mode == "always" else ("decode",)
        missing = [role for role in needed if not self.fleet.ready(role)]
        body = {"status": "ready" if not missing else "not ready", "checked": self.health.checked.is_set(),
                **({"waiting_for": [f"a ready {role} worker ({self.fleet.unavailable(role)})" for role in missing]}
                   if missing else {}),
                "ready": {role: sum(w.admitted and w.last_health == "ok" for w in ws)
                          for role, ws in self.fleet.workers.items()}}
        return not missing, body

    def _headers(self, request: Request) -> dict:
        headers = {}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        if request_id := request.headers.get("x-request-id"):
            headers["X-Request-ID"] = request_id
        return headers

    async def dispatch(self, path: str, body: dict, request: Request) -> Response:
        """Run the request; a client that disconnects before the answer starts cancels its legs (and so does this
        handler being cancelled)."""
        await self.first_checks()
        if body.get("rid") is None:  # one rid on every leg of every attempt (meta_info.id shows it)
            body = {**body, "rid": new_rid()}
        response = await unless_left(self._serve(path, body, request), wait_disconnect(request),
                                     what=f"the disconnect watch of request {body['rid']} on {path}")
        if response is LEFT:
            return Response(status_code=499)
        return with_rid(response, body["rid"])  # a failed request's error names it, for fsm-pd replay --request

    async def _serve(self, path: str, body: dict, request: Request) -> Response:
        headers = self._headers(request)
        migrating = can_migrate(path, body) and self.retry.policy == "retry" and self.retry.migrate
        if migrating:  # the decode node's chunks then say which tokens they carry
            headers[PROGRESS_HEADER] = "1"
        deadline = asyncio.get_running_loop().time() + self.request_timeout_s
        self.budget.request()
        tries = Tries(self.retry.max_retries)
        started = await self._until_started(path, body, headers, deadline, tries)
        if isinstance(started, Response):
            return started
        merge = needs_prefill_body(path, body)
        # (no prefill body: the decode recomputed and the prefill leg was not waited for; its prompt logprobs are lost)
        p_logprobs = (prefill_input_logprobs(started.prefill.body)
                      if merge and started.prefill is not None and started.prefill.body else None)
        d_resp = started.decode.response
        media_type = d_resp.headers.get("content-type", "application/json")
        # the path the answer took (pd or local) and why, on every API, and whether the decode node recomputed the
        # prompt after a failed transfer: the node's answer says it (api/streaming.py)
        route = {name: d_resp.headers[name] for name in (*ROUTE_HEADERS, RECOMPUTED_HEADER) if name in d_resp.headers}
        if started.decode.body is not None:
            await started.close()
            return Response(merge_json(started.decode.body, p_logprobs), status_code=d_resp.status_code,
                            media_type=media_type, headers=route)
        if migrating:
            stream = self._migrating(path, body, headers, deadline, tries, started)
        elif not merge and (pass_to := d_resp.extensions.get(PASS_TO)) is not None:  # an engine of this process
            return PassThrough(pass_to, status_code=d_resp.status_code, media_type=media_type, headers=route,
                               worker_url=started.worker.url, deadline=deadline, timeout_s=self.request_timeout_s,
                               lost=started.worker.lost, idle_s=self.deadlines.stream_idle_s,
                               expired=self.metrics.deadline_expired, close=started.close)
        else:
            source = merge_sse(until(d_resp.aiter_lines(), deadline), p_logprobs) if merge else d_resp.aiter_raw()
            stream = self._closing(relay(source, d_resp, started.worker.url, deadline, self.request_timeout_s,
                                         started.worker.lost, self.deadlines.stream_idle_s,
                                         self.metrics.deadline_expired), started)
        return StreamingResponse(stream, status_code=d_resp.status_code, media_type=media_type, headers=route)

    async def _closing(self, stream: AsyncIterator[bytes], started: Started) -> AsyncIterator[bytes]:
        try:
            async for chunk in stream:
                yield chunk
        finally:
            await started.close()

    async def _until_started(self, path: str, body: dict, headers: dict, deadline: float,
                             tries: Tries) -> Started | Response:
        """Attempts until one's decode answers, within the retry policy, the request's tries and the router's
        budget. Every attempt is a new bootstrap room with the client's rid."""
        key = routing_key(body)
        prefill, decode = self.fleet.pick("prefill", key=key), self.fleet.pick("decode", key=key)
        loop = asyncio.get_running_loop()
        wait_until = min(deadline, loop.time() + self.startup_wait_s)  # for a worker that is still starting
        rechecked: set[str] = set()
        while True:
            route = self._route(body, prefill, decode)
            if decode is None or (prefill is None and route.path == "pd"):
                role = "prefill" if decode is not None else "decode"
                if role not in rechecked:
                    rechecked.add(role)
                    if await self._recheck_refused(role):
                        prefill, decode = self.fleet.pick("prefill", key=key), self.fleet.pick("decode", key=key)
                        continue
                if self.fleet.starting(role) and (left := wait_until - loop.time()) > 0:
                    await self.fleet.admission(left)  # a node starting with the router: its first 200 is near
                    prefill, decode = self.fleet.pick("prefill", key=key), self.fleet.pick("decode", key=key)
                    continue
                self.metrics.gave_up.labels(f"no_{role}").inc()
                # what cut the request first (a drain's abort), when a retry was then refused otherwise
                first = f"; the first attempt: {tries.first}" if tries.first and tries.first != tries.last else ""
                last = f"; the last attempt: {tries.last}" if tries.last else ""
                return error_response(503, f"no healthy {role} worker ({self.fleet.unavailable(role)}){first}{last}",
                                      code=f"no_healthy_{role}")
            entry = self.idle_watch.entry(prompt_tokens(body)[0])
            self.metrics.routed.labels(route.path).inc()
            if route.path == "local":
                on_prefill = route.where == "prefill"  # a prefill node that serves both roles takes it whole
                outcome = await self.attempts.local(path, body, prefill if on_prefill else decode, headers, deadline,
                                                    route)
                if on_prefill:
                    self.idle_watch.served(entry)
            else:
                outcome = await self.attempts.pd(path, body, prefill, decode, headers, deadline, route,
                                              served=lambda e=entry: self.idle_watch.served(e))
            if isinstance(outcome, Started):
                self.idle_watch.started(entry)
                return outcome
            refused = self._may_retry(outcome, tries)
            if refused is not None:
                await outcome.retire(set())
                return refused
            if outcome.suspect is not None:  # its process may be gone: a refused check takes it out before the pick
                self.health.check_soon(self.client, outcome.suspect)
            # its legs on any worker the next attempt may use (every admitted one) are aborted there first
            await outcome.retire({w.url for w in self.fleet.all() if w.admitted})
            await self._backoff(tries, deadline)
            avoid = [outcome.worker] if outcome.worker is not None else []
            prefill, decode = self.fleet.pick("prefill", avoid, key), self.fleet.pick("decode", avoid, key)

    async def _recheck_refused(self, role: str) -> bool:
        """Every worker of ``role`` is out: those out for a refused connection are checked now (a refused one again
        answers in a millisecond), so a node restarted at the same address serves this request at its first 200,
        not at the next round of checks. True if one came back."""
        refused = [w for w in self.fleet.workers[role] if not w.admitted and w.reason.startswith("refused")]
        await asyncio.gather(*(self.health.check(self.client, w) for w in refused))
        return any(w.admitted for w in refused)

    def _may_retry(self, failure: Failure, tries: Tries, migration: bool = False) -> Response | None:
        """None when ``failure`` is to be tried again (counted); else the client's answer."""
        tries.last = error_message(failure.response)
        tries.first = tries.first or tries.last
        if not failure.retryable or self.retry.policy == "fail":
            return failure.response
        if tries.left <= 0 and not failure.refused:
            self.metrics.gave_up.labels("retries_exhausted").inc()
            first = f"; the first: {tries.first}" if tries.first != tries.last else ""
            return error_response(503, f"gave up after {tries.used + tries.free + 1} attempts{first}; the last: "
                                       f"{tries.last}",
                                  code="retries_exhausted")
        if not self.budget.try_retry():
            self.metrics.gave_up.labels("retry_budget").inc()
            return error_response(503, f"not retried: the router's retry budget is spent ({self.budget.describe()});"
                                       f" the failure: {tries.last}", code="retry_budget_exhausted")
        if failure.refused:  # it ran nowhere and its worker is out: a try of its own would let a dead fleet
            tries.free += 1  # use up the request's tries on workers nobody listens at (3 attempts in 30 ms)
        else:
            tries.used += 1
        kind = "migration" if migration or failure.decode_after_prefill else "retry"
        (self.metrics.migrations if kind == "migration" else self.metrics.retries).labels(failure.reason).inc()
        log.info("%s (attempt %d): %s", kind, tries.used + tries.free + 1, tries.last)
        return None

    async def _backoff(self, tries: Tries, deadline: float) -> None:
        """Wait before the next attempt (``retry_backoff``), never past the request's deadline."""
        delay = retry_backoff(tries.used + tries.free)
        await asyncio.sleep(max(0.0, min(delay, deadline - asyncio.get_running_loop().time())))

    def _route(self, body: dict, prefill: Worker | None, decode: Worker | None) -> Route:
        """This attempt's path (``policy.py``), from the prompt's length and the chosen workers' queues."""
        tokens, exact = prompt_tokens(body)
        return decide(self.pd_policy, RouteInput(
            tokens, exact, prefill_outstanding=prefill.outstanding if prefill is not None else 0,
            decode_outstanding=decode.outstanding if decode is not None else 0, prefill_available=prefill is not None,
            prefill_prefilling=prefill.prefilling if prefill is not None else 0,
            decode_prefilling=decode.prefilling if decode is not None else 0))

    async def _migrating(self, path: str, body: dict, headers: dict, deadline: float, tries: Tries,
                         started: Started) -> AsyncIterator[bytes]:
        """Relay a stream; if its decode breaks off, continue it on another pair (``migrate.py``)."""
        progress = Progress()
        try:
            while True:
                worker, response = started.worker, started.decode.response
                try:
                    async for line in until(response.aiter_lines(), deadline, worker.lost,
                                            self.deadlines.stream_idle_s):
                        if line.strip() == "data: [DONE]":
                            self.fleet.request_succeeded(worker)
                            yield DONE
                            return
                        if (failed := node_failure(line)) is not None:
                            problem = f"decode worker {worker.url} failed the stream: {failed}"
                            break
                        yield (progress.relay(line) + "\n").encode()
                    else:
                        problem = f"decode worker {worker.url} ended its stream without [DONE]"
                except StreamIdle as idle:  # a decode that went silent: the stream moves on, as from a broken one
                    self.metrics.deadline_expired("stream_idle")
                    problem = idle_message(worker.url, idle.idle_s)
                except TimeoutError:
                    self.metrics.deadline_expired("request")
                    yield _error_event(504, f"the stream did not finish within the request deadline of "
                                            f"{self.request_timeout_s:g} s (--request-timeout-secs)")
                    return
                except httpx.HTTPError as err:
                    problem = f"decode worker {worker.url} broke off its stream: {type(err).__name__}: {err}"
                except WorkerLost:
                    problem = f"decode worker {worker.url} failed its health checks mid-stream (dead, stopped or hung)"
                await started.close()
                self.fleet.request_failed(worker, problem)
                if progress.finished:  # the last token and its finish reason went out; only [DONE] is missing
                    yield DONE
                    return
                failure = Failure(error_response(502, problem, code="decode_stream_broken"), True, worker,
                                  "decode_stream_broken")
                refused = self._may_retry(failure, tries, migration=True)
                if refused is not None:
                    log.warning("stream of %s not migrated: %s", body.get("rid"), error_message(refused))
                    yield _error_event(refused.status_code, error_message(refused))
                    return
                again = await self._until_started(path, progress.continued(body), headers, deadline, tries)
                if isinstance(again, Response):
                    yield _error_event(again.status_code, error_message(again))
                    return
                started = again
                if started.decode.body is not None:  # answered whole (an error the node sent as JSON)
                    yield (progress.relay("data: " + started.decode.body.decode(errors="replace")) + "\n\n").encode()
                    yield DONE
                    return
        finally:
            await started.close()

    async def model_get(self, path: str) -> Response:
        """A model's description (``/v1/models``, ``/model_info``), from the first admitted worker, once the router
        is ready: a client that waits for ``/v1/models`` must not take a 200 from a fleet that cannot serve yet."""
        await self.first_checks()
        ready, body = self.readiness()
        if not ready:
            return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})
        worker = self.fleet.first()
        url = worker.url + path
        try:
            resp = await self.client.get(url, headers={"Authorization": f"Bearer {self.api_key}"} if self.api_key
                                         else None, timeout=PROBE_TIMEOUT_S)
        except httpx.HTTPError as err:
            return _unreachable(worker.role, url, err)
        return Response(resp.content, status_code=resp.status_code,
                        media_type=resp.headers.get("content-type", "application/json"))

    async def health_generate(self) -> Response:
        """One pair's ``/health_generate``, both at once; 200 only if both are."""
        prefill, decode = self.fleet.pick("prefill"), self.fleet.pick("decode")
        if prefill is None or decode is None:
            return JSONResponse({"healthy": False, "workers": {}}, status_code=503)
        urls = [prefill.url + "/health_generate", decode.url + "/health_generate"]

        async def probe(url: str) -> int | str:
            try:
                return (await self.client.get(url, timeout=PROBE_TIMEOUT_S)).status_code
            except httpx.HTTPError as err:
                return f"{type(err).__name__}: {err}"

        results = await asyncio.gather(*(probe(u) for u in urls))
        healthy = all(isinstance(r, int) and r < 300 for r in results)
        return JSONResponse({"healthy": healthy, "workers": dict(zip(urls, results, strict=True))},
                            status_code=200 if healthy else 503)


def _error_event(status: int, message: str) -> bytes:
    return b"data: " + json.dumps(error_body(status, message), separators=(",", ":")).encode() + b"\n\n" + DONE


