"""The router's view of its workers: which are healthy, how busy each is, and whether a failed request may be tried
again. No I/O and no asyncio here except ``HealthChecker``: everything else takes a ``clock`` (seconds, monotonic), so
the breaker, the picker and the retry budget are unit-tested with a fake one.

* **Circuit breaker, per worker.** A worker is *ejected* (no new requests) after ``health_failures`` consecutive
  failed health checks, or ``request_failures`` consecutive failed requests (counted apart: a node that answers
  ``/health`` but fails every transfer is ejected too), and at once when its ``/health`` says
  ``{"status": "draining"}`` or ``{"status": "starting"}``, or when a request or a health check finds nothing
  listening at its address (a refused connection: the process is gone). Other failed requests never eject the last
  admitted worker of a role (its health checks can). A worker whose first check fails is out at once too. It is
  *re-admitted* by the first successful health check once ``cooldown_s`` has passed since its ejection; a node
  that said it was starting, refused a connection, or failed its first check (a new process, not a flapping one),
  at once; and while any worker is out the health checks come every 0.5 s, so a restarted node takes requests as
  soon as it is ready.
* **Selection.** ``least_outstanding`` (default): the admitted worker with the fewest requests this router has in
  flight there, ties broken in turn so an idle fleet is used evenly; ``round_robin`` and ``random`` as before, over
  the admitted workers; ``cache_aware``: where the request's longest prefix went, unless the fleet is imbalanced
  (``cache_aware.py``). A caller may ask to avoid some workers (the ones that just failed a request): they are used
  only if nothing else is admitted.
* **Retry budget.** Retries over a sliding window may not exceed ``ratio`` of the requests that arrived in it, with a
  floor of ``min_per_s`` retries per second, so a lone failure is always retried and a dead fleet is not hammered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import httpx

from fsm_pd.router.cache_aware import CacheAwarePicker, CacheAwareSettings

log = logging.getLogger(__name__)

POLICIES = ("least_outstanding", "round_robin", "random", "cache_aware")
Clock = Callable[[], float]
# observer(event, role, reason): event is "ejected" or "readmitted"; the router's metrics count them
Observer = Callable[[str, str, str], None]


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    health_failures: int = 3  # consecutive failed health checks that eject a worker
    request_failures: int = 3  # consecutive failed requests that eject a worker
    cooldown_s: float = 10.0  # an ejected worker waits this long before a good health check re-admits it


@dataclass(eq=False)
class Worker:
    """One prefill or decode worker, as the router sees it."""

    role: str  # "prefill" or "decode"
    url: str  # no trailing slash
    bootstrap_port: int | str | None = None  # prefill only; None: the decode's own default (SGLang's "null");
    # "unix:PATH": a bootstrap server on a unix socket (merge.with_bootstrap)
    outstanding: int = 0  # requests this router has in flight there
    # of those, the attempts whose prompt this worker prefills and whose first token has not come yet (a whole
    # answer: until it is read): a prefill worker's PD prefills, and any worker's local requests (policy rule 3)
    prefilling: int = 0
    admitted: bool = True
    ejected_at: float = 0.0
    reason: str = ""  # why it was last ejected (or last failed), for error messages and /server_info
    health_failures: int = 0
    request_failures: int = 0
    last_health: str = "unchecked"
    starting: bool = False  # out because it is starting (its /health said so, or it never answered yet)
    # set when its health checks eject it (not a drain: a draining node finishes its streams): the streams it is
    # sending end, or move on, at once instead of waiting out the deadline on a stopped node's open connection
    lost: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    max_request_bytes: int | None = None  # its body limit, as its /health said (None: not said)

    def describe(self) -> dict:
        return {"url": self.url, "admitted": self.admitted, "outstanding": self.outstanding,
                "prefilling": self.prefilling,
                "health": self.last_health, **({"reason": self.reason} if self.reason else {}),
                **({"bootstrap_port": self.bootstrap_port} if self.role == "prefill" else {})}


class Fleet:
    """The workers of both roles, their breakers, and selection among the admitted ones. Touched from the serving
    loop only (no locks)."""

    def __init__(self, prefill: Sequence[Worker], decode: Sequence[Worker], *, policy: str = "least_outstanding",
                 breaker: BreakerSettings | None = None, clock: Clock = time.monotonic,
                 rng: random.Random | None = None, observer: Observer | None = None,
                 cache_aware: CacheAwareSettings | None = None):
        if not prefill or not decode:
            raise ValueError("a PD router needs at least one prefill and one decode worker")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        breaker = breaker or BreakerSettings()
        if min(breaker.health_failures, breaker.request_failures) < 1 or breaker.cooldown_s < 0:
            raise ValueError("the failure thresholds must be at least 1 and the cool-down not negative")
        self.workers = {"prefill": list(prefill), "decode": list(decode)}
        self.policy, self.breaker, self.clock = policy, breaker, clock
        self._rng = rng or random.Random()
        self._turn = {"prefill": 0, "decode": 0}
        # per role: with decode-side prefix caches, the decode choice follows prefixes too (the same settings)
        self._by_prefix = {role: CacheAwarePicker(cache_aware) for role in ("prefill", "decode")}
        self._observer = observer or (lambda *_: None)
        self._admitted = asyncio.Event()  # set (and replaced) at every re-admission: ``admission`` waits on it

    # selection

    def pick(self, role: str, avoid: Iterable[Worker] = (), key: str = "") -> Worker | None:
        """An admitted worker of ``role`` (not one of ``avoid`` unless it is the only kind left); None if every
        worker of the role is ejected. ``key``: the request's routing key (``cache_aware.routing_key``)."""
        admitted = [w for w in self.workers[role] if w.admitted]
        avoided = set(avoid)
        candidates = [w for w in admitted if w not in avoided] or admitted
        if not candidates:
            return None
        if self.policy == "random":
            return self._rng.choice(candidates)
        if self.policy == "cache_aware":
            return self._by_prefix[role].choose(candidates, key)
        everyone = self.workers[role]
        start = self._turn[role]
        ordered = sorted(candidates, key=lambda w: (everyone.index(w) - start) % len(everyone))  # in turn from start
        chosen = ordered[0] if self.policy == "round_robin" else min(ordered, key=lambda w: w.outstanding)
        self._turn[role] = (everyone.index(chosen) + 1) % len(everyone)
        return chosen

    def ready(self, role: str) -> bool:
        """A worker of ``role`` is admitted and its last health check passed (not merely unchecked)."""
        return any(w.admitted and w.last_health == "ok" for w in self.workers[role])

    def starting(self, role: str) -> bool:
        """Some worker of ``role`` is out only because it has not finished starting: one may be admitted soon."""
        return any(w.starting and not w.admitted for w in self.workers[role])

    def request_limit(self) -> int | None:
        """The smallest body limit a worker reported (a body over it could be routed where it is refused), or None
        while none has."""
        said = [w.max_request_bytes for w in self.all() if w.max_request_bytes]
        return min(said) if said else None

    async def admission(self, timeout_s: float) -> None:
        """Wait until a worker is re-admitted, or ``timeout_s`` passed."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._admitted.wait(), timeout_s)

    def first(self) -> Worker:
        """For requests any worker can answer (every one serves the same model): the first admitted prefill worker,
        else the first admitted decode worker (a fleet whose prefill side is down still answers), else the first
        prefill worker."""
        return next((w for role in ("prefill", "decode") for w in self.workers[role] if w.admitted),
                    self.workers["prefill"][0])

    def unavailable(self, role: str) -> str:
        """Why no worker of ``role`` can be picked: each one and its reason."""
        return "; ".join(f"{w.url} ejected: {w.reason or 'unhealthy'}" for w in self.workers[role])

    # breaker inputs

    def request_succeeded(self, worker: Worker) -> None:
        worker.request_failures = 0

    def request_failed(self, worker: Worker, reason: str) -> None:
        worker.request_failures += 1
        worker.reason = reason
        if worker.request_failures >= self.breaker.request_failures and self._others_admitted(worker):
            self._eject(worker, f"{worker.request_failures} requests failed in a row, the last: {reason}")

    def _others_admitted(self, worker: Worker) -> bool:
        """Failed requests never eject the last admitted worker of a role (its health checks still can): when one
        node's failure makes the survivors' requests fail for a while (they take its load, and compile new batch
        shapes), ejecting them too would turn a partial outage into a total one."""
        return any(w.admitted and w is not worker for w in self.workers[worker.role])

    def refused(self, worker: Worker, reason: str) -> None:
        """Nothing listens at the worker's address (its process is gone): out at once, the last of its role too (no
        request can reach it), and back at its first 200 with no cool-down (that is a new process)."""
        worker.request_failures += 1
        self._eject(worker, f"refused: {reason}", kind="refused")
        worker.ejected_at = self.clock() - self.breaker.cooldown_s

    def health_checked(self, worker: Worker, ok: bool, detail: str = "", draining: bool = False,
                       starting: bool = False, refused: bool = False) -> None:
        now = self.clock()
        worker.last_health = "ok" if ok else detail or "failed"
        if ok:
            worker.health_failures = 0
            if not worker.admitted and now - worker.ejected_at >= self.breaker.cooldown_s:
                worker.admitted, worker.request_failures, worker.reason, worker.starting = True, 0, "", False
                worker.lost = asyncio.Event()
                log.info("%s worker %s re-admitted", worker.role, worker.url)
                self._observer("readmitted", worker.role, "health_ok")
                self._admitted.set()
                self._admitted = asyncio.Event()
            return
        worker.health_failures += 1
        if draining:
            self._eject(worker, f"draining: {detail}", kind="draining")
        elif starting:
            self._eject(worker, f"starting: {detail}", kind="starting")
            worker.ejected_at = now - self.breaker.cooldown_s  # its first 200 re-admits it: no cool-down to sit out
            worker.starting = True
        elif refused:  # its process is gone (a health check gets no connection): no threshold to wait out
            self._eject(worker, f"refused: {detail}", kind="refused")
            worker.ejected_at = now - self.breaker.cooldown_s
        elif worker.health_failures >= self.breaker.health_failures:
            self._eject(worker, f"{worker.health_failures} health checks failed in a row, the last: {detail}",
                        kind="health_check")
            worker.lost.set()

    def _eject(self, worker: Worker, reason: str, kind: str = "requests") -> None:
        worker.reason = reason
        if not worker.admitted:
            worker.ejected_at = self.clock()  # still failing: the cool-down starts again
            return
        worker.admitted, worker.ejected_at = False, self.clock()
        log.warning("%s worker %s ejected: %s", worker.role, worker.url, reason)
        self._observer("ejected", worker.role, kind)

    def all(self) -> list[Worker]:
        return self.workers["prefill"] + self.workers["decode"]


OUT_CHECK_INTERVAL_S = 0.5  # the check interval while a worker is out: a ready node is taken back within 0.5 s


@dataclass
class HealthChecker:
    """GET ``/health`` on every worker every ``interval_s``; any answer but 200 within ``timeout_s`` is a failure."""

    fleet: Fleet
    interval_s: float = 5.0
    timeout_s: float = 5.0
    headers: dict = field(default_factory=dict)
    # set once every worker was checked: until then a worker is "unchecked", and may be a node still starting
    checked: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    _soon: set = field(default_factory=set, repr=False)  # checks of single workers under way (``check_soon``)

    async def check(self, client: httpx.AsyncClient, worker: Worker) -> None:
        first = worker.last_health == "unchecked"  # a worker that fails its first check is out at once, as starting
        try:
            resp = await client.get(worker.url + "/health", timeout=self.timeout_s, headers=self.headers)
        except httpx.HTTPError as err:
            self.fleet.health_checked(worker, False, f"{type(err).__name__}: {err}"[:200] or type(err).__name__,
                                      starting=first, refused=isinstance(err, httpx.ConnectError))
            return
        if resp.status_code == 200:
            worker.max_request_bytes = _said_limit(resp) or worker.max_request_bytes
            self.fleet.health_checked(worker, True)
            return
        try:
            status = resp.json().get("status")
        except (ValueError, AttributeError):
            status = None
        self.fleet.health_checked(worker, False, f"/health answered {resp.status_code}: {resp.text.strip()[:200]}",
                                  draining=status == "draining", starting=status == "starting" or first)

    def check_soon(self, client: httpx.AsyncClient, worker: Worker) -> None:
        """Check ``worker`` now, beside the rounds: a request's connection to it broke off, and if its process is
        gone the next attempt must not be sent there (a refused check takes it out at once)."""
        task = asyncio.ensure_future(self.check(client, worker))
        self._soon.add(task)
        task.add_done_callback(self._soon.discard)

    async def run(self, client: httpx.AsyncClient) -> None:
        while True:
            await asyncio.gather(*(self.check(client, w) for w in self.fleet.all()))
            self.checked.set()
            out = any(not w.admitted for w in self.fleet.all())
            await asyncio.sleep(min(self.interval_s, OUT_CHECK_INTERVAL_S) if out else self.interval_s)


def _said_limit(resp: httpx.Response) -> int | None:
    """The body limit a node's ``/health`` reports (``max_request_bytes``); None from a worker that says none (an
    SGLang node answers an empty 200)."""
    try:
        value = resp.json().get("max_request_bytes")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and value > 0 else None

