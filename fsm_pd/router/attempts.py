"""One attempt of a router request: its legs on the pair (or the one node) the router picked, what a failed attempt
tells the fleet, and the wind-down of its open legs before a retry on the same workers.

``core.py`` decides how many attempts a request gets and on which workers (retries, migrations, the policy's
path); an attempt here knows only its own legs (``legs.py``), its new bootstrap room and the client's rid.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx
from fastapi.responses import Response

from fsm_pd.api.errors import error_response
from fsm_pd.router.fleet import Fleet, Worker
from fsm_pd.router.legs import Leg, RouterDeadlines, both_answered, leg_deadline_error
from fsm_pd.router.merge import new_room, with_bootstrap
from fsm_pd.router.metrics import RouterMetrics
from fsm_pd.router.policy import Route
from fsm_pd.router.routes import RunningRequests

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 2.0  # a retry first aborts the failed attempt's open legs on the workers it reuses


@dataclass
class Failure:
    """An attempt that ended before its answer reached the client."""

    response: Response  # what the client gets if this is the end
    retryable: bool
    worker: Worker | None  # the worker to blame (its breaker counts it), if any
    reason: str  # a metric label: "{side}_unreachable", "{side}_{status}", "request_timeout"
    decode_after_prefill: bool = False  # the prefill had finished: re-running it is a migration
    refused: bool = False  # nothing listened at the worker: the request ran nowhere, and the worker is out
    suspect: Worker | None = None  # a worker whose connection broke off: check its health before the next attempt
    # closes the attempt's legs; those still open on the workers the next attempt uses are aborted there first
    retire: Callable[[set[str]], Awaitable[None]] | None = None


@dataclass
class Started:
    """An attempt whose decode answered: its leg, and ``close`` to call once its answer is relayed."""

    prefill: Leg | None  # None: the decode node prefilled the request itself (the policy's local path)
    decode: Leg
    worker: Worker
    close: Callable[[], Awaitable[None]]


def needs_prefill_body(path: str, body: dict) -> bool:
    """The client's answer merges the prefill's prompt logprobs (``merge.prefill_input_logprobs``)."""
    return path == "/generate" and bool(body.get("return_logprob"))


def error_code(response: Response) -> str | None:
    try:
        return json.loads(response.body)["error"]["code"]
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def error_message(response: Response) -> str:
    try:
        return json.loads(response.body)["error"]["message"]
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"status {response.status_code}"


def closer(decode: Worker, release: Callable[[], None], leg: Leg) -> Callable[[], Awaitable[None]]:
    """An attempt's ``close``: once its decode leg is done with, let go of the decode node's slot and the running
    entry, and close the leg; later calls do nothing."""
    closed = False

    async def close() -> None:
        nonlocal closed
        if not closed:
            closed = True
            decode.outstanding -= 1
            release()
            await leg.close()

    return close


class Attempts:
    """Runs one attempt at a time for the router; ``finishing`` holds the prefill answers still awaited beside their
    decode's relay (the router's ``aclose`` cancels them)."""

    def __init__(self, client: Callable[[], httpx.AsyncClient], fleet: Fleet, metrics: RouterMetrics,
                 running: RunningRequests, deadlines: RouterDeadlines, api_key: str | None, request_timeout_s: float):
        self._client = client  # the router's, made on first use on the serving loop
        self.fleet, self.metrics, self.running = fleet, metrics, running
        self.deadlines, self.api_key, self.request_timeout_s = deadlines, api_key, request_timeout_s
        self.finishing: set[asyncio.Task] = set()

    @property
    def client(self) -> httpx.AsyncClient:
        return self._client()

    async def local(self, path: str, body: dict, decode: Worker, headers: dict, deadline: float,
                    route: Route) -> Started | Failure:
        """One leg: the node (a decode node, or a prefill node that serves both roles) prefills the prompt itself
        and decodes it (``fsm_pd_route`` local, a room and no bootstrap host: only this router sends it, so an
        SGLang worker never gets one)."""
        rid, room = body["rid"], new_room()  # the room: the attempt's identity (and seed) on the node
        release = self.running.add(rid, (decode.url, decode.url)) if isinstance(rid, str) else lambda: None
        sent = {k: v for k, v in body.items() if k not in ("bootstrap_host", "bootstrap_port")}
        sent.update(bootstrap_room=room, fsm_pd_route=route.wire())
        decode.outstanding += 1
        decode.prefilling += 1
        leg = Leg(decode.role, decode.url, self.client, decode.url + path, sent, headers, whole=False,
                  timeout_s=self.deadlines.decode_s, deadline_name="decode_leg")
        close = closer(decode, release, leg)
        try:
            failed = await _answered(leg, deadline, self.request_timeout_s, decode.lost, bool(body.get("stream")))
        except BaseException:
            await close()
            raise
        finally:  # its first token came, or it failed
            decode.prefilling -= 1
        if failed is None:
            if leg.body is not None:
                self.fleet.request_succeeded(decode)
            return Started(None, leg, decode, close)
        failure = self._classify(failed[0], failed[1], decode, decode, None)

        async def retire(reused: set[str]) -> None:
            try:
                await self._wind_down(rid, room, (leg,) if decode.url in reused else ())
            finally:
                await close()

        failure.retire = retire
        return failure

    async def pd(self, path: str, body: dict, prefill: Worker, decode: Worker, headers: dict,
                       deadline: float, route: Route | None = None,
                       served: Callable[[], None] = lambda: None) -> Started | Failure:
        rid, room = body["rid"], new_room()  # the attempt's identity on both nodes: the client's rid, a new room
        pair = (prefill.url, decode.url)
        release = self.running.add(rid, pair) if isinstance(rid, str) else lambda: None
        sent = with_bootstrap(body, prefill.url, prefill.bootstrap_port, room)
        if route is not None:  # the decode node journals why this request went through a prefill node
            sent["fsm_pd_route"] = route.wire()
        prefill.outstanding += 1
        prefill.prefilling += 1
        decode.outstanding += 1
        p_leg = Leg("prefill", prefill.url, self.client, prefill.url + path, sent, headers, whole=True,
                    timeout_s=self.deadlines.prefill_s)
        d_leg = Leg("decode", decode.url, self.client, decode.url + path, sent, headers, whole=False,
                    timeout_s=self.deadlines.decode_s)
        close = closer(decode, release, d_leg)

        async def close_both() -> None:
            try:
                await p_leg.close()
            finally:  # also when the caller is cancelled while the first one closes
                await close()

        try:
            failed = await both_answered(p_leg, d_leg, deadline, self.request_timeout_s, (prefill.lost, decode.lost),
                                         prefill_body=needs_prefill_body(path, body), stream=bool(body.get("stream")))
        except BaseException:
            prefill.outstanding -= 1
            await close_both()
            raise
        finally:  # the decode's first token came (the prompt is prefilled), or the attempt failed
            prefill.prefilling -= 1
        if failed is None and not p_leg.task.done() and not d_leg.recomputed and not p_leg.lost:
            # the decode's stream started, so its KV arrived: the prefill's answer comes beside the relay. It is
            # not cut short when the stream ends first (its room may still be finishing the handoff; a
            # disconnect would abort it there), only at the request's deadline.
            finishing = asyncio.ensure_future(self._prefill_answered(prefill, p_leg, deadline, served))
            self.finishing.add(finishing)
            finishing.add_done_callback(self.finishing.discard)
            return Started(p_leg, d_leg, decode, close)
        prefill.outstanding -= 1
        if failed is None:
            # else the decode recomputed without it, or its node died and the decode answered alone
            if p_leg.task.done() and not p_leg.task.cancelled() and p_leg.failure() is None:
                self.fleet.request_succeeded(prefill)
                served()
            elif p_leg.task.done() and p_leg.unreachable():
                self.fleet.request_failed(prefill, error_message(p_leg.failure()))
            try:
                await p_leg.close()
            except BaseException:  # cancelled while the prefill's call ended: nobody will close the decode leg
                await close()
                raise
            if d_leg.body is not None:
                self.fleet.request_succeeded(decode)
            return Started(p_leg, d_leg, decode, close)
        leg, response = failed
        failure = self._classify(leg, response, prefill, decode, p_leg)

        async def retire(reused: set[str]) -> None:
            try:
                await self._wind_down(rid, room, tuple(leg for leg in (p_leg, d_leg) if leg.worker_url in reused))
            finally:
                await close_both()

        failure.retire = retire
        return failure

    async def _prefill_answered(self, prefill: Worker, leg: Leg, deadline: float,
                                served: Callable[[], None] = lambda: None) -> None:
        """A prefill answer still to come after its decode's stream started: the attempt has its KV either way, so
        the answer only counts for the prefill worker's load and breaker."""
        due = min(deadline, leg.deadline)
        try:
            await asyncio.wait({leg.task}, timeout=max(0.0, due - asyncio.get_running_loop().time()))
        finally:
            prefill.outstanding -= 1
            passed = not leg.task.done()
            await leg.close()  # cancels it if the deadline passed first
        if passed:
            which = "request" if due >= deadline else "prefill_leg"
            self.metrics.deadline_expired(which)
            log.warning("the prefill worker %s did not answer within the %s deadline after its decode had the KV",
                        prefill.url, which)
        if leg.task.cancelled():
            return
        if (err := leg.task.exception()) is not None and not isinstance(err, httpx.HTTPError):
            log.error("the prefill call to %s raised: %r", prefill.url, err)
            return
        failed = leg.failure()
        if failed is None:
            self.fleet.request_succeeded(prefill)
            served()
        elif leg.unreachable() or failed.status_code >= 500:
            log.warning("prefill worker %s failed after its decode had the KV: %s", prefill.url, error_message(failed))
            self.fleet.request_failed(prefill, error_message(failed))

    def _classify(self, leg: Leg | None, response: Response, prefill: Worker, decode: Worker,
                  p_leg: Leg | None) -> Failure:
        if leg is None:  # the request's own deadline: nothing left to retry with
            self.metrics.deadline_expired("request")
            return Failure(response, False, None, "request_timeout")
        worker = prefill if leg.side == "prefill" else decode
        after = (leg.side == "decode" and p_leg is not None and p_leg.task.done() and not p_leg.task.cancelled()
                 and p_leg.failure() is None)
        if leg.lost:  # ejected by its health checks already
            return Failure(response, True, worker, f"{leg.side}_lost", after)
        if leg.timed_out:  # its own deadline: the worker holds the request and says nothing; another pair may not
            self.metrics.deadline_expired(leg.deadline_name)
            self.fleet.request_failed(worker, error_message(response))
            return Failure(response, True, worker, f"{leg.side}_timeout", after)
        if leg.refused():  # the process is gone: out at once, so the retry goes elsewhere
            self.fleet.refused(worker, error_message(response))
            return Failure(response, True, worker, f"{leg.side}_refused", after, refused=True)
        if leg.unreachable():
            self.fleet.request_failed(worker, error_message(response))
            return Failure(response, True, worker, f"{leg.side}_unreachable", after,
                           suspect=worker if leg.broke_off() else None)
        status = response.status_code
        if status == 409:  # a room this node had before: a new room is the cure, the node is fine
            return Failure(response, True, None, f"{leg.side}_409", after)
        if status >= 500:
            if error_code(response) == "starting":  # a restarted node, not yet ready: out until its /health says 200
                self.fleet.health_checked(worker, False, error_message(response), starting=True)
            else:
                self.fleet.request_failed(worker, error_message(response))
            return Failure(response, True, worker, f"{leg.side}_{status}", after)
        return Failure(response, False, None, f"{leg.side}_{status}")

    async def _wind_down(self, rid, room: int, legs: tuple[Leg, ...]) -> None:
        """Before a retry on a worker the failed attempt used: abort that attempt there, by its rid and room, where
        its leg is still open. The abort can only reach this attempt (the retry has the same rid and a new room), so
        nothing it or the leg's closing does later can touch the retry. It frees the attempt at once, and it also
        holds when it reaches the worker before the attempt's own request does (its partner failed at once: a
        draining prefill's 503): the worker remembers the room and refuses that request when it comes."""
        open_legs = [leg for leg in legs if not (leg.task.done() and (leg.task.cancelled() or leg.task.exception()
                                                                     or leg.body is not None))]
        if not open_legs or not isinstance(rid, str):
            return
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None

        async def abort(leg: Leg) -> None:
            try:
                async with asyncio.timeout(ABORT_TIMEOUT_S):
                    resp = await self.client.post(leg.worker_url + "/abort_request", json={"rid": rid, "room": room},
                                                  headers=headers)
            except (httpx.HTTPError, TimeoutError) as err:
                problem = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
            else:
                if resp.status_code == 200:
                    return
                problem = f"it answered {resp.status_code}: {resp.text.strip()[:200]}"
            # the leg is closed all the same: the worker then sees a disconnect and aborts the attempt itself
            log.warning("could not abort request %s (room %d) on the %s worker %s before its retry: %s", rid, room,
                        leg.side, leg.worker_url, problem)

        await asyncio.gather(*(abort(leg) for leg in open_legs))


async def _answered(leg: Leg, deadline: float, timeout_s: float, lost: asyncio.Event,
                    stream: bool = False) -> tuple[Leg | None, Response] | None:
    """A lone decode leg's ``both_answered``: None once its answer started (or was read whole), else the failed leg
    (None: the request's deadline passed; ``timed_out``: the leg's own) and the client's error answer."""
    watcher = asyncio.ensure_future(lost.wait())
    due = min(deadline, leg.deadline)
    try:
        done, _ = await asyncio.wait({leg.task, watcher}, return_when=asyncio.FIRST_COMPLETED,
                                     timeout=max(0.0, due - asyncio.get_running_loop().time()))
    finally:
        watcher.cancel()
    if not done and due < deadline:
        leg.timed_out = True
        return leg, leg_deadline_error(leg, stream)
    if not done:
        return None, error_response(504, f"no answer from the {leg.side} worker {leg.worker_url} within the request "
                                         f"deadline of {timeout_s:g} s (--request-timeout-secs)",
                                    code="request_timeout")
    if leg.task not in done:
        leg.lost = True
        return leg, error_response(502, f"{leg.side} worker {leg.worker_url} failed its health checks before it "
                                        "answered (dead, stopped or hung)", code=f"{leg.side}_lost")
    failed = leg.failure()
    return None if failed is None else (leg, failed)
