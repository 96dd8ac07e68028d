"""A decode stream of an engine in the router's own process (``--role pd``) goes to the client as the engine's app
sends it (``router/passthrough.py``), and keeps every promise ``legs.relay`` keeps: the client on a real socket on
127.0.0.1, the router calling its workers' ASGI apps in-process (``local_apps``), as ``serve_pd`` wires them.

The workers are stand-in ASGI apps that answer ``/health`` and play a script of SSE events; a real API app over a
stub engine checks the PD path too. Each test also checks the decode's load accounting: its slot and running entry
are released however the stream ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time

import httpx
import pytest
from polling import until as wait_until
from stub_engine import StubEngine
from test_deadlines import expiries
from test_router import sse_data
from test_router_failures import error_event

from fsm_pd.api import AppServer, create_app
from fsm_pd.router import create_router_app
from fsm_pd.router.app import PrefillWorker, RetrySettings
from fsm_pd.router.fleet import BreakerSettings
from fsm_pd.router.legs import RouterDeadlines
from fsm_pd.router.policy import PolicySettings

CLIENT_TIMEOUT_S = 60.0  # far beyond every deadline here: a hang shows as the client's timeout
SLACK_S = 5.0  # a deadline's end, its error and the client's read, on a loaded 2-core machine
RELAYED = RetrySettings(migrate=False)  # as serve_pd: one decode engine, its bytes relayed as they come


def event(text: str, finish: str | None = None) -> bytes:
    meta = {"id": "x", "finish_reason": {"type": finish} if finish else None}
    return b"data: " + json.dumps({"text": text, "meta_info": meta}).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


class ScriptedEngine:
    """An engine app stand-in: ``/health`` answers 200 (503 once ``sick``), a generation request gets a 200 event
    stream whose body ``script(send)`` sends. ``heard`` keeps what the app received after the request (a
    ``http.disconnect`` when its leg was closed)."""

    def __init__(self, script) -> None:
        self.script, self.heard, self.sick, self.requests = script, [], False, 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["path"] == "/health":
            status = 503 if self.sick else 200
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": b'{"status": "ok"}'})
            return
        await receive()
        self.requests += 1
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})

        async def body(data: bytes, more: bool = True) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": more})

        # as a real app does: the script runs until it ends or the client (the router's leg) goes away
        playing, listening = asyncio.ensure_future(self.script(body)), asyncio.ensure_future(receive())
        await asyncio.wait({playing, listening}, return_when=asyncio.FIRST_COMPLETED)
        if not listening.done():
            playing.result()  # a script that raised fails the app mid-answer
            await asyncio.wait({listening}, timeout=10)
        playing.cancel()
        listening.cancel()
        if listening.done() and not listening.cancelled():
            self.heard.append(listening.result()["type"])


@contextlib.contextmanager
def local_router(tmp_path, decode, prefill=None, policy: str = "never", **router_kw):
    """A router whose workers are apps of its own process (their socket files exist, as in serve_pd, and are never
    connected to); yields (router URL, the PDRouter)."""
    listeners, apps = [], {}
    paths = {}
    for role, app in (("prefill", prefill or decode), ("decode", decode)):
        path = paths[role] = str(tmp_path / f"{role}.sock")
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(path)
        listeners.append(listener)
        apps[path] = app
    bootstrap = f"unix:{tmp_path / 'bootstrap.sock'}"
    router = create_router_app([PrefillWorker(f"unix:{paths['prefill']}", bootstrap)], [f"unix:{paths['decode']}"],
                               local_apps=apps, pd_policy=PolicySettings(policy), health_interval_s=0.2,
                               **{"retry": RELAYED, **router_kw})
    try:
        with AppServer(router) as server:
            yield server.url, router.state.router
    finally:
        for listener in listeners:
            listener.close()


def released(pd) -> bool:
    """The decode's slot and the request's running entry were given back (``attempts.closer``)."""
    return pd.fleet.workers["decode"][0].outstanding == 0 and len(pd.running) == 0


def generate(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/generate", json={"text": "a", "stream": True, **body}, timeout=CLIENT_TIMEOUT_S)


def test_a_whole_stream_reaches_the_client_byte_for_byte(tmp_path):
    sent = [event("a"), event("ab"), event("abc", "length"), DONE]

    async def script(body):
        for data in sent:
            await body(data)
            await asyncio.sleep(0.01)
        await body(b"", more=False)

    engine = ScriptedEngine(script)
    with local_router(tmp_path, engine) as (url, pd):
        r = generate(url)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.content == b"".join(sent)
        assert wait_until(lambda: released(pd))
    assert engine.heard == ["http.disconnect"]  # the leg closed after the end, as a socket would


def test_each_chunk_reaches_the_client_before_the_engine_sends_the_next(tmp_path):
    read_first = asyncio.Event()  # set on the router's loop by the client's thread, once it read the first chunk
    loops = []

    async def script(body):
        loops.append(asyncio.get_running_loop())
        await body(event("a"))
        await asyncio.wait_for(read_first.wait(), 10)
        await body(event("ab", "stop"))
        await body(DONE)
        await body(b"", more=False)

    engine = ScriptedEngine(script)
    with local_router(tmp_path, engine) as (url, pd), httpx.stream(
            "POST", url + "/generate", json={"text": "a", "stream": True}, timeout=CLIENT_TIMEOUT_S) as r:
        chunks = r.iter_bytes()
        assert next(chunks) == event("a")
        loops[0].call_soon_threadsafe(read_first.set)
        assert b"".join(chunks) == event("ab", "stop") + DONE


@pytest.mark.parametrize("how", ["raises", "no_done", "finished_no_done"])
def test_a_stream_that_breaks_off_ends_with_an_error_event_and_done(tmp_path, how):
    async def script(body):
        await body(event("a"))
        if how == "raises":
            raise RuntimeError("the engine fell over")
        if how == "finished_no_done":
            await body(event("ab", "length"))
        await body(b"", more=False)

    engine = ScriptedEngine(script)
    with local_router(tmp_path, engine) as (url, pd):
        r = generate(url)
        assert r.status_code == 200 and json.loads(sse_data(r.text)[0])["text"] == "a"
        if how == "finished_no_done":  # the answer was whole: only its [DONE] is added
            assert sse_data(r.text)[-1] == "[DONE]" and all("error" not in e for e in sse_data(r.text)[:-1])
        else:
            err = error_event(r.text)
            assert err["code"] == 502 and pd.fleet.workers["decode"][0].url in err["message"]
            assert ("broke off its stream" if how == "raises" else "without [DONE]") in err["message"]
            if how == "raises":
                assert "the engine fell over" in err["message"]
        assert wait_until(lambda: released(pd))


def silent_after_first(body_sent: list):
    async def script(body):
        await body(event("a"))
        body_sent.append(time.monotonic())
        await asyncio.Event().wait()  # silent until the leg is closed (then cancelled)
    return script


@pytest.mark.timeout(60)
def test_a_silent_stream_ends_at_the_idle_deadline_and_its_leg_is_closed(tmp_path):
    engine = ScriptedEngine(silent_after_first([]))
    with local_router(tmp_path, engine, deadlines=RouterDeadlines(stream_idle_s=1.0)) as (url, pd):
        started = time.monotonic()
        r = generate(url)
        took = time.monotonic() - started
        err = error_event(r.text)
        assert err["code"] == 504 and "sent no token for 1 s (stream idle deadline" in err["message"], err
        assert 1.0 <= took < 1.0 + SLACK_S, took
        assert wait_until(lambda: released(pd))
        assert expiries(url)["stream_idle"] == 1
    assert engine.heard == ["http.disconnect"]


@pytest.mark.timeout(60)
def test_a_stream_that_keeps_going_ends_at_the_request_deadline(tmp_path):
    async def script(body):
        while True:  # never silent for the idle deadline, never finished
            await body(event("a"))
            await asyncio.sleep(0.05)

    engine = ScriptedEngine(script)
    with local_router(tmp_path, engine, request_timeout_s=1.5) as (url, pd):
        started = time.monotonic()
        r = generate(url)
        assert 1.5 <= time.monotonic() - started < 1.5 + SLACK_S
        events = sse_data(r.text)
        assert len(events) > 3 and json.loads(events[0])["text"] == "a"
        err = error_event(r.text)
        assert err["code"] == 504 and "request deadline of 1.5 s" in err["message"]
        assert wait_until(lambda: released(pd))
        assert expiries(url)["request"] == 1
    assert engine.heard == ["http.disconnect"]


@pytest.mark.timeout(60)
def test_a_decode_that_fails_its_health_checks_mid_stream_ends_it(tmp_path):
    sent: list = []
    engine = ScriptedEngine(silent_after_first(sent))
    with local_router(tmp_path, engine, breaker=BreakerSettings(health_failures=1)) as (url, pd), \
            httpx.stream("POST", url + "/generate", json={"text": "a", "stream": True},
                         timeout=CLIENT_TIMEOUT_S) as r:
        chunks = r.iter_bytes()
        assert next(chunks) == event("a")
        engine.sick = True  # its next health check ejects it
        err = error_event(b"".join(chunks).decode())
        assert err["code"] == 502 and "failed its health checks mid-stream" in err["message"]
        assert wait_until(lambda: released(pd))
    assert engine.heard == ["http.disconnect"]


@pytest.mark.timeout(60)
def test_a_client_that_leaves_mid_stream_closes_the_leg(tmp_path):
    engine = ScriptedEngine(silent_after_first([]))
    with local_router(tmp_path, engine) as (url, pd):
        with httpx.stream("POST", url + "/generate", json={"text": "a", "stream": True},
                          timeout=CLIENT_TIMEOUT_S) as r:
            assert next(r.iter_bytes()) == event("a")
        assert wait_until(lambda: engine.heard == ["http.disconnect"]), "the engine's app kept the stream"
        assert wait_until(lambda: released(pd))
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert 'fsm_pd_router_requests_total{route="/generate",status="499"} 1.0' in metrics


def test_a_pd_stream_of_the_real_api_app_passes_through(tmp_path):
    prefill, decode = StubEngine(role="prefill"), StubEngine(role="decode")
    try:
        with local_router(tmp_path, create_app(decode, decode.tokenizer),
                          create_app(prefill, prefill.tokenizer, bootstrap_port=9000), policy="always") as (url, pd):
            r = httpx.post(url + "/v1/completions", json={"model": "stub-model", "prompt": "hi", "stream": True,
                                                          "max_tokens": 4}, timeout=CLIENT_TIMEOUT_S)
            events = sse_data(r.text)
            assert r.status_code == 200 and events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert all("error" not in c for c in chunks) and chunks[-1]["choices"][0]["finish_reason"]
            assert prefill.submitted and decode.submitted  # both legs ran
            assert wait_until(lambda: released(pd))
    finally:
        prefill.close()
        decode.close()
