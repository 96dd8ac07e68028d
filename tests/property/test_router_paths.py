"""Property suite of the built-in router's two paths (``fsm_pd/router``): whichever path a request takes (``pd``
through a prefill node, or ``local``, served whole by a decode node or by a prefill node that serves both roles) and
whatever fails on the way, the client's request ends exactly once, its answer is the one the model gives with no token
lost or repeated across retries and migrations, its receipt names the attempt that answered, the router's in-flight
counts come back to 0 and the path of every attempt is the policy's.

The production ``PDRouter`` runs in process; only its network is simulated (``tests/pd_workers.py``: an
``httpx.MockTransport`` whose workers answer as fsm-pd nodes do on the wire, each call with a scripted fate, and
record every call). Hypothesis draws the fleet (1-2 prefill and 1-2 decode workers, some of them down from the start),
the policy (``auto`` with or without ``--prefill-serves-local``, ``always``, ``never``), the retry policy, and a batch
of concurrent ``/generate`` requests, streamed or not, some with prompt logprobs, with prompts around the threshold
and the fates of their calls (``pd_workers``: refused, unreachable, broken off, silent, an engine error, slow, a node
that stops). The two tests at the end are defects these properties found, fixed since: a whole decode answer
discarded for its prefill's late failure (``legs._both_answered``), and an error event after a stream's finish
(``legs.relay``).

``FSM_PD_PROPERTY_PROFILE=long`` runs 1000 random examples; ``FSM_PD_PROPERTY_EXAMPLES`` sets the count.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass

import httpx
import pytest
from fastapi.responses import StreamingResponse
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st
from pd_workers import (
    AFTER_K_TOKENS,
    BENIGN,
    PREFILL_FAILURES,
    SERVE_FAILURES,
    Call,
    Workers,
    prompt_logprobs,
    rollout,
)

from fsm_pd.api.streaming import PROGRESS_FIELD
from fsm_pd.router.core import PDRouter, PrefillWorker, RetrySettings
from fsm_pd.router.fleet import BreakerSettings
from fsm_pd.router.legs import RouterDeadlines
from fsm_pd.router.policy import BUSY_FACTOR, PolicySettings

PROFILES = {"ci": {"max_examples": 100, "derandomize": True}, "long": {"max_examples": 1000, "derandomize": False}}
PROFILE = os.environ.get("FSM_PD_PROPERTY_PROFILE", "ci")
_profile = dict(PROFILES[PROFILE])
if os.environ.get("FSM_PD_PROPERTY_EXAMPLES"):
    _profile["max_examples"] = int(os.environ["FSM_PD_PROPERTY_EXAMPLES"])

# Small deadlines so a silent worker costs a fraction of a second; the request's own is far off, and never expected.
DEADLINES = RouterDeadlines(prefill_s=0.25, decode_s=0.25, stream_idle_s=0.1)
REQUEST_TIMEOUT_S = 5.0
SCENARIO_LIMIT_S = 30.0  # a scenario still running then has a request that hangs
# Health checks often enough that a stopped node is ejected (and its streams end as lost) before the stream idle
# deadline: one failed check ejects (the default is 3), a check times out after HEALTH_TIMEOUT_S.
HEALTH_INTERVAL_S = HEALTH_TIMEOUT_S = 0.02
BREAKER = BreakerSettings(health_failures=1)


@dataclass(frozen=True)
class FleetPlan:
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    unhealthy: frozenset[str]
    policy: PolicySettings
    retry: RetrySettings


@dataclass(frozen=True)
class Req:
    rid: str
    prompt: tuple[int, ...]
    n: int  # max_new_tokens
    stream: bool
    logprob: bool  # return_logprob: the prefill's prompt logprobs merged; a stream that does not migrate
    serve: tuple[tuple, ...]  # the fates of its serve calls, in order
    prefill: tuple[tuple, ...]  # ... and of its prefill calls


serve_fates = st.one_of(
    st.just(("ok",)), st.tuples(st.just("slow"), st.integers(1, 4)), st.just(("refuse",)), st.just(("unreachable",)),
    st.tuples(st.just("break"), st.integers(0, 4)), st.tuples(st.just("eof"), st.integers(0, 4)),
    st.tuples(st.just("abort"), st.integers(0, 4), st.sampled_from([500, 502, 503, 504])),
    st.tuples(st.just("silent"), st.integers(0, 4)))
prefill_fates = st.one_of(
    st.just(("ok",)), st.tuples(st.just("slow"), st.integers(1, 4)),
    st.sampled_from([("refuse",), ("unreachable",), ("hang",), ("kv_then_hang",), ("kv_then_error",)]))
# a node that stops takes every request it has or gets with it: drawn in some scenarios only, whose other requests
# then need not succeed
serve_fates_or_stop = st.one_of(serve_fates, st.tuples(st.just("stop"), st.integers(0, 4)))
prefill_fates_or_stop = st.one_of(prefill_fates, st.just(("stop",)))


@st.composite
def fleets(draw) -> FleetPlan:
    prefill = ("p0", "p1")[:draw(st.integers(1, 2))]
    decode = ("d0", "d1")[:draw(st.integers(1, 2))]
    # mostly all up; sometimes a worker (or a whole role) is down from the start
    unhealthy = draw(st.one_of(st.just(frozenset()), st.just(frozenset()), st.just(frozenset()),
                               st.frozensets(st.sampled_from(prefill + decode), max_size=2)))
    mode = draw(st.sampled_from(["auto", "auto", "auto", "always", "never"]))
    policy = PolicySettings(mode, draw(st.sampled_from([4, 8, 12])), prefill_serves_local=draw(st.booleans()))
    retry = RetrySettings(draw(st.sampled_from(["retry", "retry", "retry", "fail"])),
                          draw(st.sampled_from([0, 1, 2, 2, 3])))
    return FleetPlan(prefill, decode, unhealthy, policy, retry)


@st.composite
def batches(draw, limit: int) -> list[Req]:
    stops = draw(st.booleans())
    serve, prefill = (serve_fates_or_stop, prefill_fates_or_stop) if stops else (serve_fates, prefill_fates)
    reqs = []
    for j in range(draw(st.integers(1, 5))):
        length = draw(st.one_of(st.sampled_from([1, limit, limit + 1, BUSY_FACTOR * limit,
                                                 BUSY_FACTOR * limit + 1]), st.integers(1, 3 * limit)))
        reqs.append(Req(f"r{j}", tuple(range(100 * j + 1, 100 * j + 1 + length)), draw(st.integers(1, 6)),
                        draw(st.booleans()), draw(st.sampled_from([False, False, False, True])),
                        tuple(draw(st.lists(serve, max_size=3))), tuple(draw(st.lists(prefill, max_size=2)))))
    return reqs


@st.composite
def scenarios(draw) -> tuple[FleetPlan, list[Req]]:
    fleet = draw(fleets())
    return fleet, draw(batches(fleet.policy.local_prefill_max_tokens))


@dataclass
class Ended:
    """What the client got: a status, and a whole body or the stream's events (parsed, ``[DONE]`` as the string)."""

    status: int
    body: dict | None
    events: list | None
    seconds: float

    @property
    def chunks(self) -> list[dict]:
        return [e for e in self.events if isinstance(e, dict) and "error" not in e]

    @property
    def errors(self) -> list[dict]:
        return [e for e in self.events if isinstance(e, dict) and "error" in e]

    @property
    def answer(self) -> dict | None:
        """The complete answer, if the request succeeded."""
        if self.events is None:
            return self.body if self.status == 200 else None
        if self.errors or not self.chunks or not self.chunks[-1]["meta_info"].get("finish_reason"):
            return None
        return self.chunks[-1]


class StayingClient:
    """The ASGI request as ``dispatch`` reads it: a client that waits for its whole answer."""

    headers: dict = {}

    def __init__(self):
        self._never = asyncio.Event()

    async def receive(self) -> dict:
        await self._never.wait()
        return {"type": "http.disconnect"}


async def ask(router: PDRouter, req: Req) -> Ended:
    loop = asyncio.get_running_loop()
    began = loop.time()
    body = {"rid": req.rid, "input_ids": list(req.prompt), "stream": req.stream, "return_logprob": req.logprob,
            "sampling_params": {"max_new_tokens": req.n, "temperature": 0}}
    response = await router.dispatch("/generate", body, StayingClient())
    if not isinstance(response, StreamingResponse):
        return Ended(response.status_code, json.loads(response.body), None, loop.time() - began)
    raw = b"".join([chunk async for chunk in response.body_iterator])
    events = []
    for line in raw.decode().split("\n"):
        if line.startswith("data:"):
            data = line[5:].strip()
            events.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert not line.strip(), f"{req.rid}: a line that is not an event: {line!r}"
    return Ended(response.status_code, None, events, loop.time() - began)


async def quiescent(keep: set[asyncio.Future]) -> None:
    """Until no task but ``keep`` is left: every leg, retry and prefill answer awaited beside a relay has ended."""
    while others := asyncio.all_tasks() - keep:
        await asyncio.wait(others)


async def run(fleet: FleetPlan, reqs: list[Req]) -> tuple[dict[str, Ended], Workers, PDRouter]:
    workers = Workers({r.rid: list(r.serve) for r in reqs}, {r.rid: list(r.prefill) for r in reqs}, fleet.unhealthy,
                      HEALTH_TIMEOUT_S)
    router = PDRouter([PrefillWorker(f"http://{h}", 8998) for h in fleet.prefill],
                      [f"http://{h}" for h in fleet.decode], health_interval_s=HEALTH_INTERVAL_S,
                      health_timeout_s=HEALTH_TIMEOUT_S, breaker=BREAKER, request_timeout_s=REQUEST_TIMEOUT_S,
                      retry=fleet.retry, deadlines=DEADLINES, pd_policy=fleet.policy)
    router._client = httpx.AsyncClient(transport=httpx.MockTransport(workers))
    ours = asyncio.all_tasks()
    try:
        ended = await asyncio.gather(*(ask(router, r) for r in reqs))
        await quiescent({*ours, router._health_task})
        return {r.rid: e for r, e in zip(reqs, ended, strict=True)}, workers, router
    finally:
        router._health_task.cancel()
        await router.aclose()


def failing(fates: tuple[tuple, ...], failures: tuple[str, ...]) -> int:
    return sum(fate[0] in failures for fate in fates)


def mid_stream(fate: tuple) -> bool:
    """A failure after the first token: a stream that does not migrate (logprobs) ends there."""
    return fate[0] in AFTER_K_TOKENS and fate[1] > 0


def up(fleet: FleetPlan, role: str) -> bool:
    return any(h not in fleet.unhealthy for h in (fleet.prefill if role == "prefill" else fleet.decode))


def check(fleet: FleetPlan, reqs: list[Req], ended: dict[str, Ended], workers: Workers, router: PDRouter) -> None:
    # a node that stops fails every request it has or gets: then no request's own script says whether it succeeds
    nodes_stop = any(f[0] == "stop" for r in reqs for f in r.serve + r.prefill)
    for req in reqs:
        mine = [c for c in workers.calls if c.rid == req.rid]
        answer = check_ended_once(req, ended[req.rid], mine)
        if check_served_if_it_could_be(fleet, req, ended[req.rid], answer, mine, not nodes_stop):
            check_no_duplicate(fleet, req, mine)
            check_receipt(req, answer, mine)
    check_paths(fleet, workers)
    check_counts(router, workers.calls)


def check_ended_once(req: Req, end: Ended, mine: list[Call]) -> dict | None:
    """1 and 2: one answer, or one error (a stream's last event before its one [DONE]), within the deadline; a
    stream's chunks each add the model's next token to the one before. Returns the complete answer, if any."""
    rid, expected = req.rid, rollout(list(req.prompt), req.n)
    assert end.seconds <= REQUEST_TIMEOUT_S + 1, f"{rid} took {end.seconds:.2f} s"
    if end.events is not None:
        assert end.events and end.events[-1] == "[DONE]", f"{rid}: the stream did not end with [DONE]: {end.events}"
        assert end.events.count("[DONE]") == 1, f"{rid}: [DONE] twice: {end.events}"
        assert len(end.errors) <= 1 and (not end.errors or end.events[-2] is end.errors[0]), \
            f"{rid}: an error event that is not the stream's last: {end.events}"
        assert end.errors or end.answer is not None, f"{rid}: a stream that ended unfinished without an error: " \
                                                     f"{end.events} (attempts: {describe(mine)})"
        sent: list[int] = []
        for chunk in end.chunks:
            ids = chunk["output_ids"]
            assert PROGRESS_FIELD not in chunk, f"{rid}: the client got the router's progress field: {chunk}"
            assert len(ids) == len(sent) + 1 and ids[:len(sent)] == sent, \
                f"{rid}: the stream went from {sent} to {ids} (attempts: {describe(mine)})"
            assert ids == expected[:len(ids)], f"{rid}: tokens {ids}, the model's {expected}"
            sent = ids
    elif end.status != 200:
        assert "error" in end.body, f"{rid}: an error status without an error body: {end.body}"
    if (answer := end.answer) is not None:
        assert answer["output_ids"] == expected, f"{rid}: answered {answer['output_ids']}, the model's {expected}"
        if req.logprob:  # the prompt's logprobs once, from whichever node prefilled it
            assert answer["meta_info"]["input_token_logprobs"] == prompt_logprobs(list(req.prompt)), \
                f"{rid}: prompt logprobs {answer['meta_info']['input_token_logprobs']} (attempts: {describe(mine)})"
    return answer


def check_served_if_it_could_be(fleet: FleetPlan, req: Req, end: Ended, answer: dict | None, mine: list[Call],
                                live: bool) -> bool:
    """A request is refused when no worker can serve its path, and (``live``: no node stops) answered when nothing
    it met failed, or when its failures were all retryable and no more than its retries. False: it was refused (no
    calls to check)."""
    rid = req.rid
    if not up(fleet, "decode") or (fleet.policy.mode == "always" and not up(fleet, "prefill")):
        role = "decode" if not up(fleet, "decode") else "prefill"
        assert end.status == 503 and end.body["error"]["code"] == f"no_healthy_{role}", (rid, end)
        assert not mine, f"{rid}: calls to a fleet without a healthy {role} worker: {describe(mine)}"
        return False
    served = [c for c in mine if c.side == "serve"]
    if not live:
        return True
    if all(f[0] in BENIGN for f in req.serve + req.prefill):
        assert answer is not None, f"{rid}: nothing failed, yet it ended {end} (attempts: {describe(mine)})"
        assert len(served) == 1, f"{rid}: nothing failed, yet attempts {describe(mine)}"
    elif (fleet.retry.policy == "retry" and not any(f[0] == "abort" and f[2] == 504 for f in req.serve)
          and not (req.stream and req.logprob and any(mid_stream(f) for f in req.serve))
          and failing(req.serve, SERVE_FAILURES) + failing(req.prefill, PREFILL_FAILURES) <= fleet.retry.max_retries):
        assert answer is not None, \
            f"{rid}: its failures were fewer than its retries, yet it ended {end} (attempts: {describe(mine)})"
    return True


def check_no_duplicate(fleet: FleetPlan, req: Req, mine: list[Call]) -> None:
    """One serve call of a request at a time, each closed by the end; no more attempts than its retries allow (one
    under ``--retry-policy fail``), besides those refused; a migration continues with the stream's seed."""
    rid, served = req.rid, [c for c in mine if c.side == "serve"]
    attempts = {c.room for c in mine}
    # an attempt that found a worker's address refused uses no try: it ran nowhere and took that worker out
    refused = len({c.room for c in mine if c.fate[0] == "unreachable"})
    allowed = 1 + fleet.retry.max_retries + refused if fleet.retry.policy == "retry" else 1
    assert len(attempts) <= allowed, f"{rid}: {len(attempts)} attempts, allowed {allowed}: {describe(mine)}"
    for before, after in zip(served, served[1:], strict=False):
        assert before.left is not None and before.left <= after.entered, \
            f"{rid}: two serve calls at once: {describe([before, after])}"
    for c in mine:
        assert c.left is not None, f"{rid}: a call still open after the request ended: {describe([c])}"
        assert c.host not in fleet.unhealthy, f"{rid}: sent to {c.host}, down from the start: {describe([c])}"
        if c.before:
            first = next(s for s in served if s.sent and s.entered < c.entered)
            assert c.resume_seed == first.seed, f"{rid}: resumed with seed {c.resume_seed}, not {first.seed}"


def check_receipt(req: Req, answer: dict | None, mine: list[Call]) -> None:
    """3. An answer's receipt names the attempt that answered, the request's last: the node that served it whole,
    or the decode leg whose room had a prefill leg on the prefill node it names."""
    if answer is None:
        return
    rid, served = req.rid, [c for c in mine if c.side == "serve"]
    finished = [c for c in served if c.finished]
    assert finished and finished[-1] is served[-1], f"{rid}: attempts after its answer: {describe(mine)}"
    answering, receipt = served[-1], answer["meta_info"]["pd_route"]
    assert receipt["path"] == answering.path, f"{rid}: receipt {receipt}, answered by {describe([answering])}"
    if answering.path == "local":
        assert receipt["node"] == answering.host and answering.prefill is None, (receipt, answering)
    else:
        assert receipt["prefill"] == answering.prefill, (receipt, answering)
        assert [c.host for c in mine if c.side == "prefill" and c.room == answering.room] == \
            [answering.prefill], f"{rid}: its decode's room had no prefill leg: {describe(mine)}"


def check_paths(fleet: FleetPlan, workers: Workers) -> None:
    """5. Every attempt took the policy's path (``policy.decide``) for what the router could see: the prompt's
    length, which roles had a healthy worker, and (the reason says) the in-flight counts."""
    policy, limit = fleet.policy, fleet.policy.local_prefill_max_tokens
    for c in workers.calls:
        tokens = len(c.prompt)
        where = f"{c.rid} ({tokens} prompt tokens, limit {limit}) went {c.path} on {c.host}: {c.reason!r}"
        if c.side == "prefill":
            assert c.host in fleet.prefill and c.path == "pd", where
            continue
        assert c.host in (fleet.decode if c.path == "pd" else fleet.decode + fleet.prefill), where
        if policy.mode == "always":
            assert c.path == "pd" and c.reason == "policy always", where
        elif policy.mode == "never":
            assert c.path == "local" and c.host in fleet.decode and c.reason == "policy never", where
        elif not up(fleet, "prefill") or c.reason == "no healthy prefill worker":
            # every prefill node down from the start, or stopped before (its health checks then ejected it)
            gone = all(h in fleet.unhealthy or workers.stopped.get(h, c.entered) < c.entered for h in fleet.prefill)
            assert gone and c.path == "local" and c.host in fleet.decode, where
            assert c.reason == "no healthy prefill worker", where
        elif tokens <= limit:
            assert c.path == "local", where
            # on the prefill node only when it serves both roles, and the router says why
            assert (c.host in fleet.prefill) == ("on the prefill node" in c.reason), where
            assert c.host in fleet.decode or policy.prefill_serves_local, where
        elif tokens <= BUSY_FACTOR * limit:
            assert c.path == "pd" or (c.host in fleet.decode and "prefill busier" in c.reason), where
        else:
            assert c.path == "pd", where


def check_counts(router: PDRouter, calls: list[Call]) -> None:
    """4. Once every request ended, no worker has any of them counted in flight or prefilling (the policy decides
    from these counts), none is registered as running, and ``routed`` counted each attempt once, by its path; a PD
    attempt is one prefill leg and one decode leg in one room."""
    for worker in router.fleet.all():
        assert worker.outstanding == 0, f"{worker.role} worker {worker.url} has {worker.outstanding} in flight " \
                                        f"after every request ended (calls: {describe(calls)})"
        assert worker.prefilling == 0, f"{worker.role} worker {worker.url} has {worker.prefilling} prompts " \
                                       f"prefilling after every request ended (calls: {describe(calls)})"
    assert len(router.running) == 0, "requests still registered as running after every request ended"
    for path in ("pd", "local"):
        rooms = {(c.rid, c.room) for c in calls if c.path == path}
        counted = router.metrics.registry.get_sample_value("fsm_pd_router_routed_total", {"path": path}) or 0
        assert counted == len(rooms), f"routed{{path={path}}} counted {counted}, the workers saw {len(rooms)} attempts"
    for rid, room in {(c.rid, c.room) for c in calls if c.path == "pd"}:
        legs = sorted(c.side for c in calls if c.room == room)
        assert legs == ["prefill", "serve"], f"{rid}: a PD attempt's legs {legs}: {describe(calls)}"


def describe(calls: list[Call]) -> str:
    return "; ".join(f"{c.side} {c.path} on {c.host} room {c.room % 1000} fate {c.fate} sent {c.sent}"
                     f"{' (finished)' if c.finished else ''}{f' resumed at {len(c.before)}' if c.before else ''}"
                     for c in calls) or "none"


@pytest.mark.timeout(300 if PROFILE == "ci" else 0)  # a failing example shrinks (minutes); long: unbounded
@settings(**_profile, deadline=None, print_blob=True, report_multiple_bugs=False,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenarios())
def test_every_request_ends_once_with_its_tokens_whatever_path_it_took_and_whatever_failed(scenario):
    fleet, reqs = scenario
    note(f"{fleet}\n" + "\n".join(map(str, reqs)))
    try:
        ended, workers, router = asyncio.run(asyncio.wait_for(run(fleet, reqs), SCENARIO_LIMIT_S))
    except TimeoutError:
        pytest.fail(f"a request hung: no end within {SCENARIO_LIMIT_S} s")
    check(fleet, reqs, ended, workers, router)
    event(f"scenario: {fleet.policy.mode}, {'a node stops' if workers.stopped else 'no node stops'}")
    for req in reqs:  # what the examples covered (pytest --hypothesis-show-statistics)
        mine = [c for c in workers.calls if c.rid == req.rid]
        event(f"{'streamed' if req.stream else 'whole'}{' with logprobs' if req.logprob else ''} "
              f"{'answered' if ended[req.rid].answer else 'failed'}")
        event(f"attempts {len({c.room for c in mine})}")
        for c in mine:
            event(f"{c.side} {c.path} on {c.host[0]}: {c.fate[0]}{' (resumed)' if c.before else ''}")



@pytest.mark.parametrize("prefill_fate", ["kv_then_error", "kv_then_hang"])
def test_a_whole_answer_the_decode_node_sent_is_not_discarded_for_its_prefill_s_late_failure(prefill_fate):
    """A non-streamed PD request whose decode node answered it whole (so the KV had arrived) ends with that answer,
    and is not run again, even when the prefill node's own HTTP answer fails or never comes after the transfer: the
    client's answer needs nothing from it (no ``return_logprob``), as for a stream (``_prefill_answered``)."""
    fleet = FleetPlan(("p0",), ("d0",), frozenset(), PolicySettings("always"), RetrySettings("retry", 1))
    reqs = [Req("r0", (1, 2, 3), 3, False, False, (), ((prefill_fate,),))]
    ended, workers, _ = asyncio.run(asyncio.wait_for(run(fleet, reqs), SCENARIO_LIMIT_S))
    decode = [c for c in workers.calls if c.side == "serve"]
    assert decode[0].finished  # the decode node sent its whole answer
    assert ended["r0"].answer is not None, f"the client got {ended['r0']}"
    assert len(decode) == 1, f"the decode node served it {len(decode)} times: {describe(workers.calls)}"
    assert ended["r0"].seconds < DEADLINES.prefill_s, f"the answer waited {ended['r0'].seconds:.2f} s for the prefill"


@pytest.mark.parametrize("retry_policy, logprob", [("fail", False), ("retry", True)], ids=["retry_fail", "logprobs"])
def test_a_stream_whose_finish_went_out_does_not_end_in_an_error(retry_policy, logprob):
    """A stream whose node sent the last token and its finish reason, then closed without ``[DONE]``, gave the client
    its whole answer: it ends with ``[DONE]``, as a migrating stream does, not with an error after the answer."""
    fleet = FleetPlan(("p0",), ("d0",), frozenset(), PolicySettings("never"), RetrySettings(retry_policy, 1))
    reqs = [Req("r0", (1, 2), 2, True, logprob, (("eof", 2),), ())]
    ended, _, _ = asyncio.run(asyncio.wait_for(run(fleet, reqs), SCENARIO_LIMIT_S))
    end = ended["r0"]
    assert end.chunks[-1]["meta_info"]["finish_reason"]  # the whole answer went out
    assert not end.errors, f"an error after the whole answer: {end.errors}"


def test_a_request_that_runs_out_of_workers_names_its_first_failure_too():
    """A stream its one decode node cut (a drain past its bound), whose migration then found no healthy decode worker
    (the node stopped and was ejected), ends with an error naming both failures: the last alone hides what cut the
    stream (test_drain.py saw the drain's abort replaced by the refusal of the migration)."""
    fleet = FleetPlan(("p0",), ("d0",), frozenset(), PolicySettings("always"), RetrySettings("retry", 2))
    reqs = [Req("r0", (1, 2), 4, True, False, (("abort", 1, 503), ("stop", 0)), ())]
    ended, workers, _ = asyncio.run(asyncio.wait_for(run(fleet, reqs), SCENARIO_LIMIT_S))
    (error,) = ended["r0"].errors
    message = error["error"]["message"]
    assert message.startswith("no healthy decode worker"), message
    assert "the first attempt: decode worker http://d0 failed the stream: the request was aborted" in message, message
    assert "the last attempt: decode worker http://d0 failed its health checks" in message, message
