"""Every wait in the serving path is bounded, and the error that ends it names what it waited for (docs/operations.md,
Waits). Real sockets on 127.0.0.1: the router in front of workers that answer their health checks and then say
nothing on a request (SGLang #32267: 200 sent, then a stall until a 300 s default), stub engines behind the real API
app, and, for the rooms' own deadlines, real ``fsm-pd serve`` processes with the tiny model.

Each test carries a pytest timeout far below the default deadlines it replaces: take the deadline away and the test
fails on its timeout instead of hanging.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import pytest
from polling import until as wait_until
from processes import Cluster
from raw_worker import raw_worker
from stub_engine import StubEngine
from test_router import NO_RETRY, sse_data
from test_router_failures import FIRST_EVENT, SSE_HEAD, StallsAfterFirstToken, chunk, error_event
from test_router_retries import sse_event

from fsm_pd.api import AppServer, create_app
from fsm_pd.api.runner import WaitDeadlines
from fsm_pd.effects.faults import FaultConfig
from fsm_pd.router import create_router_app
from fsm_pd.router.legs import RouterDeadlines
from fsm_pd.router.policy import CLASSIC_PD, PolicySettings

CLIENT_TIMEOUT_S = 60.0  # beyond every short deadline here; the defaults they stand for are minutes
SLACK_S = 5.0  # a deadline's end, its error and the client's read, on a loaded 2-core machine


def expiries(url: str, metric: str = "fsm_pd_router_deadline_expiries_total") -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {m[1]: float(m[2]) for m in re.finditer(metric + r'\{deadline="(\w+)"\} (\S+)', text)}


@contextlib.contextmanager
def router_over(prefill_url: str, decode_urls: list[str], **router_kw):
    with AppServer(create_router_app([(prefill_url, 9000)], decode_urls,
                                            **{"pd_policy": CLASSIC_PD, **router_kw})) as router:
        yield router.url


@contextlib.contextmanager
def served(engine: StubEngine, **app_kw):
    try:
        with AppServer(create_app(engine, engine.tokenizer, bootstrap_port=9000, **app_kw)) as server:
            yield server.url
    finally:
        engine.close()


# --- the router's deadlines ---


@pytest.mark.timeout(60)
def test_a_stream_whose_decode_goes_silent_after_its_200_ends_at_the_idle_deadline():
    with contextlib.ExitStack() as stack:
        decode = stack.enter_context(raw_worker(SSE_HEAD + chunk(FIRST_EVENT)))
        p_url = stack.enter_context(served(StubEngine(role="prefill")))
        url = stack.enter_context(router_over(p_url, [decode.url], retry=NO_RETRY,
                                              deadlines=RouterDeadlines(stream_idle_s=1.0)))
        started = time.monotonic()
        r = httpx.post(url + "/generate", json={"text": "a", "stream": True}, timeout=CLIENT_TIMEOUT_S)
        took = time.monotonic() - started
        assert r.status_code == 200 and json.loads(sse_data(r.text)[0])["text"] == "a"  # relayed, then the error
        err = error_event(r.text)
        assert err["code"] == 504 and err["message"] == (f"decode worker {decode.url} sent no token for 1 s (stream "
                                                         "idle deadline, --stream-idle-timeout-secs)")
        assert 1.0 <= took < 1.0 + SLACK_S, took
        assert decode.hung_up.wait(10), "the router kept the silent stream's connection open"
        assert expiries(url) == {"request": 0, "prefill_leg": 0, "decode_leg": 0, "stream_idle": 1}


@pytest.mark.timeout(60)
def test_a_generate_stream_whose_decode_goes_silent_moves_to_another_decode():
    event = {"id": "cmpl-s-1", "object": "text_completion", "choices": [{"index": 0, "text": " h",
                                                                         "finish_reason": None}]}
    head = SSE_HEAD + sse_event(event, [32, 104])
    good = StubEngine(role="decode")
    with contextlib.ExitStack() as stack:
        silent = stack.enter_context(raw_worker(head))
        p_url = stack.enter_context(served(StubEngine(role="prefill")))
        d_url = stack.enter_context(served(good))
        url = stack.enter_context(router_over(p_url, [silent.url, d_url],
                                              deadlines=RouterDeadlines(stream_idle_s=1.0)))
        assert wait_until(lambda: httpx.get(url + "/health", timeout=5).json()["admitted"]["decode"] == 2)
        body = {"prompt": "hi", "stream": True, "rid": "s-1", "max_tokens": 5, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=CLIENT_TIMEOUT_S)
        events = [json.loads(x) for x in sse_data(r.text)[:-1]]
        assert all("error" not in e for e in events), r.text
        assert "".join(c["text"] for e in events for c in e["choices"]) == " hell"
        assert silent.requests and good.submitted[0].generated_before == [32, 104]  # went to the silent one first
        assert expiries(url)["stream_idle"] == 1


@pytest.mark.timeout(60)
def test_a_whole_answer_whose_decode_leg_never_finishes_ends_at_the_decode_legs_deadline():
    prefill = StubEngine(role="prefill")
    with contextlib.ExitStack() as stack:
        decode = stack.enter_context(raw_worker(b""))
        p_url = stack.enter_context(served(prefill))
        url = stack.enter_context(router_over(p_url, [decode.url], retry=NO_RETRY,
                                              deadlines=RouterDeadlines(decode_s=1.0)))
        started = time.monotonic()
        r = httpx.post(url + "/generate", json={"text": "a"}, timeout=CLIENT_TIMEOUT_S)
        took = time.monotonic() - started
        assert r.status_code == 504, r.text
        error = r.json()["error"]
        assert error["code"] == "decode_timeout" and error["message"] == (
            f"the decode worker {decode.url} did not answer within 1 s (the decode leg's deadline, "
            "--decode-timeout-secs)")
        assert 1.0 <= took < 1.0 + SLACK_S, took
        assert decode.hung_up.wait(10)
        assert expiries(url) == {"request": 0, "prefill_leg": 0, "decode_leg": 1, "stream_idle": 0}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True])
def test_a_lone_leg_to_a_node_that_prefills_itself_ends_at_the_decode_legs_deadline(stream):
    with contextlib.ExitStack() as stack:
        decode = stack.enter_context(raw_worker(b""))
        p_url = stack.enter_context(served(StubEngine(role="prefill")))
        url = stack.enter_context(router_over(p_url, [decode.url], retry=NO_RETRY, pd_policy=PolicySettings("never"),
                                              deadlines=RouterDeadlines(decode_s=1.0)))
        r = httpx.post(url + "/generate", json={"text": "a", "stream": stream}, timeout=CLIENT_TIMEOUT_S)
        assert r.status_code == 504, r.text
        assert b'"fsm_pd_route"' in decode.requests_bodies[0]  # the lone (local) leg, not a PD attempt
        what = "sent no first token" if stream else "did not answer"
        assert r.json()["error"]["message"] == (f"the decode worker {decode.url} {what} within 1 s (the decode leg's "
                                                "deadline, --decode-timeout-secs)")
        assert decode.hung_up.wait(10)
        assert expiries(url)["decode_leg"] == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True])
def test_a_prefill_leg_that_never_answers_ends_at_its_deadline_and_closes_the_decode_leg(stream):
    decode = StubEngine(role="decode", hang=True)  # waits for KV that will never come
    with contextlib.ExitStack() as stack:
        prefill = stack.enter_context(raw_worker(b""))
        d_url = stack.enter_context(served(decode))
        url = stack.enter_context(router_over(prefill.url, [d_url], retry=NO_RETRY,
                                              deadlines=RouterDeadlines(prefill_s=1.0)))
        started = time.monotonic()
        r = httpx.post(url + "/generate", json={"text": "a", "stream": stream}, timeout=CLIENT_TIMEOUT_S)
        took = time.monotonic() - started
        assert r.status_code == 504, r.text
        error = r.json()["error"]
        assert error["code"] == "prefill_timeout" and error["message"] == (
            f"the prefill worker {prefill.url} did not answer within 1 s (the prefill leg's deadline, "
            "--prefill-timeout-secs)")
        assert 1.0 <= took < 1.0 + SLACK_S, took
        assert prefill.hung_up.wait(10)
        assert wait_until(lambda: decode.aborted == [decode.submitted[0].rid]), "the decode leg was left waiting"
        assert expiries(url) == {"request": 0, "prefill_leg": 1, "decode_leg": 0, "stream_idle": 0}


# --- a node's wait on its engine ---


@pytest.mark.timeout(60)
def test_a_node_stream_whose_engine_stops_producing_ends_with_an_error_event_naming_the_idle_deadline():
    engine = StallsAfterFirstToken(role="colocated")
    with served(engine, wait=WaitDeadlines(first_output_s=30.0, idle_s=1.0)) as url:
        started = time.monotonic()
        r = httpx.post(url + "/generate", json={"text": "a", "stream": True, "rid": "idle-1"},
                       timeout=CLIENT_TIMEOUT_S)
        took = time.monotonic() - started
        assert r.status_code == 200 and json.loads(sse_data(r.text)[0])["text"] == "a"
        err = error_event(r.text)
        assert err["code"] == 504 and err["message"] == ("request idle-1: the colocated engine produced no token for "
                                                         "1 s after its output 1 (token idle deadline, "
                                                         "--token-idle-timeout-secs)")
        assert 1.0 <= took < 1.0 + SLACK_S, took
        assert wait_until(lambda: engine.aborted == ["idle-1"]), "the stalled request was not aborted"
        assert expiries(url, "fsm_pd_request_deadline_expiries_total") == {"first_token": 0, "token_idle": 1}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True])
def test_a_node_request_whose_engine_never_starts_is_a_504_naming_the_first_token_deadline(stream):
    engine = StubEngine(role="colocated", hang=True)
    with served(engine, wait=WaitDeadlines(first_output_s=1.0, idle_s=30.0)) as url:
        r = httpx.post(url + "/generate", json={"text": "a", "stream": stream, "rid": "first-1"},
                       timeout=CLIENT_TIMEOUT_S)
        assert r.status_code == 504, r.text
        assert r.json()["error"]["message"] == ("request first-1: the colocated engine produced no first token "
                                                "within 1 s (first-token deadline, --first-token-timeout-secs)")
        assert wait_until(lambda: engine.aborted == ["first-1"]), "the request was not aborted"
        assert expiries(url, "fsm_pd_request_deadline_expiries_total") == {"first_token": 1, "token_idle": 0}


# --- a room's own deadline, on real nodes ---

DEADLINE_S = 3.0


@dataclass(frozen=True)
class Stall:
    """A fault that keeps the decode node's room from Success, and the deadline that must end it."""

    timer: str
    state: str
    waits_for: str
    prefill_faults: dict
    decode_faults: dict


STALLS = {
    # the prefill node's READY never arrives: the room waits in WaitingForInput
    "waiting": Stall("waiting", "WaitingForInput", "the prefill node's READY (its prefill done and the KV published)",
                     {"FSM_PD_FAULT_DROP_MESSAGE": "1", "FSM_PD_FAULT_MESSAGES": "READY"}, {}),
    # the pull is held back past the deadline: the room waits in Transferring
    "transfer": Stall("transfer", "Transferring", "the KV to be pulled, checked and scattered", {},
                      {"FSM_PD_FAULT_PULL_DELAY_S": str(DEADLINE_S + 5)}),
}


@pytest.fixture(scope="module")
def stalls(tmp_path_factory):
    """A prefill node and a decode node (each stall's deadline set by its flag, ``DEADLINE_S``; no recompute) behind
    the router, one pair for both stalls: each node rereads its faults from a file (``FSM_PD_FAULT_FILE``), and none
    is injected while the pause file exists. ``(cluster, router URL, pause file, {role: (node URL, fault file)})``."""
    tmp = tmp_path_factory.mktemp("stalls")
    cluster = Cluster(tmp)
    try:
        pause = tmp / "faults-paused"
        pause.touch()
        files = {role: tmp / f"{role}-faults" for role in ("prefill", "decode")}
        env = {role: {**cluster.env, "FSM_PD_FAULT_PAUSE_FILE": str(pause), "FSM_PD_FAULT_FILE": str(files[role])}
               for role in files}
        boot = str(free_port())
        flags = [arg for stall in sorted(STALLS) for arg in (f"--{STALLS[stall].timer}-timeout", str(DEADLINE_S))]
        (p, _), (d, _) = started = [
            cluster.launch_node("prefill", "--bootstrap-port", boot, env=env["prefill"]),
            cluster.launch_node("decode", *flags, "--on-transfer-failure", "fail", env=env["decode"])]
        cluster.healthy(started)
        router = cluster.router(p, int(boot), d, "--retry-policy", "fail")
        yield cluster, router, pause, {"prefill": (p, files["prefill"]), "decode": (d, files["decode"])}
    finally:
        cluster.stop()


def set_faults(nodes: dict, faults: dict[str, dict]) -> None:
    """Each node's faults from now on (none for a role not given), once its ``/server_info`` reports them."""
    for role, (url, path) in nodes.items():
        settings = faults.get(role, {})
        new = path.with_suffix(".new")
        new.write_text("".join(f"{name}={value}\n" for name, value in settings.items()))
        new.replace(path)  # whole, at once: the node never reads half a file
        want = FaultConfig.from_env({"FSM_PD_FAULT_FILE": str(path), **settings}).describe()
        assert wait_until(lambda u=url, w=want: httpx.get(u + "/server_info", timeout=10).json()[
            "internal_states"][0]["faults"] == w), role


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stall", sorted(STALLS))
def test_a_room_that_never_reaches_success_fails_naming_its_deadline_and_replay_names_it(stall, stalls):
    """Fault injection keeps the decode node's room from Success until its deadline (3 s by the flag); without
    recompute the request fails, and the client's error and replay both name that deadline, what the room waited for
    in which state, its length and the flag and variable that set it. Both stalls on one pair of nodes (``stalls``),
    whose decode node has both deadlines' flags: each stall meets its own."""
    cluster, router, pause, nodes = stalls
    stall = STALLS[stall]
    flag = f"--{stall.timer}-timeout"
    env_var = f"FSM_PD_{stall.timer.upper()}_TIMEOUT"
    rid = f"stalled-{stall.timer}"
    pause.touch()  # the warm-up request runs fault-free
    set_faults(nodes, {"prefill": stall.prefill_faults, "decode": stall.decode_faults})
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    assert httpx.post(router + "/generate", json=body, timeout=120).status_code == 200  # compiled and warm
    pause.unlink()
    try:
        began = time.monotonic()
        r = httpx.post(router + "/generate", json={**body, "rid": rid}, timeout=CLIENT_TIMEOUT_S)
        took = time.monotonic() - began
    finally:
        pause.touch()
    assert r.status_code in (502, 504), r.text
    message = r.json()["error"]["message"]
    # the decode's own failure (504, with the length), or the prefill's, aborted by it (502): whichever leg's
    # answer reached the router first; both name the decode's deadline and what the room waited for
    assert ("the decode node waited" in message and f"in {stall.state} for {stall.waits_for}" in message
            and f"its {stall.timer} deadline ({flag} / ${env_var})" in message), message
    assert DEADLINE_S <= took < DEADLINE_S + SLACK_S + 5, took
    journals = [str(next(cluster.tmp.glob(f"{role}-*.db"))) for role in ("prefill", "decode")]
    out = subprocess.run([sys.executable, "-m", "fsm_pd.cli", "replay", *journals, "--request", rid,
                          "--format", "json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    sides = [s for a in json.loads(out.stdout)["attempts"] for s in a["sides"]]
    assert [s["deadline"] for s in sides if s["role"] == "decode"] == [{
        "timer": stall.timer, "state": stall.state, "seconds": DEADLINE_S, "flag": flag, "env": env_var,
        "waits_for": stall.waits_for,
        "explained": f"the decode node waited {DEADLINE_S:g} s in {stall.state} for {stall.waits_for}: its "
                     f"{stall.timer} deadline ({flag} / ${env_var})"}]


def free_port() -> int:
    from fsm_pd.cli.launch import free_port as port

    return port()
