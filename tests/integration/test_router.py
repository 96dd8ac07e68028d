"""The built-in PD router in front of stub prefill/decode servers, all on 127.0.0.1 over real sockets."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import socket
import threading
import time

import httpx
import pytest
from polling import until
from stub_engine import DECODE_LOGPROB, PREFILL_LOGPROB, StubEngine

from fsm_pd.api import AppServer, create_app
from fsm_pd.cli.launch import free_port
from fsm_pd.router import build_arg_parser, create_router_app
from fsm_pd.router.app import PrefillWorker, RetrySettings, parse_prefill_specs
from fsm_pd.router.policy import CLASSIC_PD
from fsm_pd.serving.types import EngineError

NO_RETRY = RetrySettings(policy="fail")  # the tests of how one failed attempt reaches the client


class WaitsForDecode(StubEngine):
    """A prefill that answers only once the decode has the same room: proof that the router runs both legs at
    once (a router calling them one after the other would see this prefill fail)."""

    def __init__(self, decode: StubEngine, **kw):
        super().__init__(role="prefill", **kw)
        self.decode = decode

    def _prefill(self, request, stream, stop):
        if not self.decode.wait_submitted(len(self.submitted), timeout_s=5.0):
            stream.push(EngineError("the decode never got the request", 500))
            return
        super()._prefill(request, stream, stop)


@contextlib.contextmanager
def pd_cluster(prefills: list[StubEngine], decodes: list[StubEngine], *, ports=None, **router_kw):
    """Serves each engine and a router over them; yields (router_url, prefill_urls, decode_urls)."""
    ports = ports or [9000 + i for i in range(len(prefills))]
    with contextlib.ExitStack() as stack:
        p_urls = [stack.enter_context(AppServer(create_app(e, e.tokenizer, bootstrap_port=port))).url
                  for e, port in zip(prefills, ports, strict=True)]
        d_urls = [stack.enter_context(AppServer(create_app(e, e.tokenizer, bootstrap_port=8998))).url
                  for e in decodes]
        router = create_router_app(list(zip(p_urls, ports, strict=True)), d_urls,
                                   **{"pd_policy": CLASSIC_PD, **router_kw})
        url = stack.enter_context(AppServer(router)).url
        yield url, p_urls, d_urls
        for engine in prefills + decodes:
            engine.close()


def sse_data(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


@pytest.fixture
def pair():
    prefill, decode = StubEngine(role="prefill"), StubEngine(role="decode")
    with pd_cluster([prefill], [decode]) as (url, _, _):
        yield url, prefill, decode


def test_both_legs_get_the_same_bootstrap_fields(pair):
    url, prefill, decode = pair
    r = httpx.post(url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3},
                                            "bootstrap_room": 1}, timeout=10)
    assert r.status_code == 200 and r.json()["text"] == " he"
    # the answer is the decode leg's: the prefill leg may be seen a moment after it, on a busy machine
    assert prefill.wait_submitted(1) and decode.wait_submitted(1)
    p, d = prefill.submitted[0], decode.submitted[0]
    assert p.bootstrap == d.bootstrap
    assert (p.bootstrap.host, p.bootstrap.port) == ("127.0.0.1", 9000)
    assert p.bootstrap.room != 1 and 0 <= p.bootstrap.room < 2**63  # a client's room is overwritten
    assert p.seed == d.seed  # both derived from the room
    second = httpx.post(url + "/generate", json={"text": "hi"}, timeout=10)
    assert second.status_code == 200 and prefill.wait_submitted(2)
    assert prefill.submitted[1].bootstrap.room != p.bootstrap.room


def test_legs_run_concurrently():
    decode = StubEngine(role="decode")
    with pd_cluster([WaitsForDecode(decode)], [decode]) as (url, _, _):
        r = httpx.post(url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=20)
        assert r.status_code == 200, r.text


def test_null_bootstrap_port_lets_decode_use_its_default():
    prefill, decode = StubEngine(role="prefill"), StubEngine(role="decode")
    with contextlib.ExitStack() as stack:
        p = stack.enter_context(AppServer(create_app(prefill, prefill.tokenizer, bootstrap_port=8998)))
        d = stack.enter_context(AppServer(create_app(decode, decode.tokenizer, bootstrap_port=8998)))
        router = stack.enter_context(AppServer(create_router_app([p.url], [d.url], pd_policy=CLASSIC_PD)))
        assert httpx.post(router.url + "/generate", json={"text": "a"}, timeout=10).status_code == 200
        assert prefill.submitted[0].bootstrap.port == decode.submitted[0].bootstrap.port == 8998


@pytest.mark.parametrize("stream", [False, True])
def test_prefill_failure_cancels_decode_and_returns_prefills_error(stream):
    prefill = StubEngine(role="prefill", fail_after=0)
    decode = StubEngine(role="decode", hang=True)  # waits for KV that will never come
    with pd_cluster([prefill], [decode], retry=NO_RETRY) as (url, _, _):
        r = httpx.post(url + "/generate", json={"text": "hi", "stream": stream}, timeout=10)
        assert r.status_code == 500
        assert r.json()["error"]["message"] == "stub prefill: injected KV transfer failure"
        assert decode.wait_submitted(1)
        assert until(lambda: decode.aborted == [decode.submitted[0].rid]), "decode leg was not cancelled"


def test_prefill_4xx_is_passed_through():
    prefill = StubEngine(role="prefill", submit_error=EngineError("prompt refused by prefill", 400))
    decode = StubEngine(role="decode", hang=True)
    with pd_cluster([prefill], [decode]) as (url, _, _):
        r = httpx.post(url + "/v1/completions", json={"model": "stub-model", "prompt": "a"}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["message"] == "prompt refused by prefill"


def checked_by(router_url: str) -> None:
    """Wait for the router's first round of health checks (requested through its /health)."""
    assert until(lambda: httpx.get(router_url + "/health", timeout=5).json()["checked"])


def test_a_prefill_gone_since_its_health_check_is_502_and_cancels_decode():
    prefill, decode = StubEngine(role="prefill"), StubEngine(role="decode", hang=True)
    with AppServer(create_app(decode, decode.tokenizer)) as d:
        p = AppServer(create_app(prefill, prefill.tokenizer, bootstrap_port=9000)).start()
        router = create_router_app([(p.url, 9000)], [d.url], retry=NO_RETRY, pd_policy=CLASSIC_PD)
        with AppServer(router) as rs:
            checked_by(rs.url)
            p.stop()  # admitted by its check, gone before the next one
            r = httpx.post(rs.url + "/generate", json={"text": "a"}, timeout=10)
            assert r.status_code == 502 and "prefill worker" in r.json()["error"]["message"]
            assert until(lambda: len(decode.submitted) == len(decode.aborted))
        decode.close()
    prefill.close()


def test_a_worker_that_never_answered_is_out_and_the_router_says_why():
    """A router started before its nodes sends nothing to a node still starting (not yet listening): a request waits
    for it within --worker-startup-wait-secs, then gets a 503 that says why."""
    dead = f"http://127.0.0.1:{free_port()}"
    decode = StubEngine(role="decode")
    with AppServer(create_app(decode, decode.tokenizer)) as d:
        with AppServer(create_router_app([(dead, 9000)], [d.url], retry=NO_RETRY, pd_policy=CLASSIC_PD,
                                         startup_wait_s=0.3)) as rs:
            r = httpx.post(rs.url + "/generate", json={"text": "a"}, timeout=10)
            assert r.status_code == 503, r.text
            message = r.json()["error"]["message"]
            assert "prefill" in message and dead in message and "starting" in message, message
            assert decode.submitted == []
            assert httpx.get(rs.url + "/health", timeout=5).json()["admitted"] == {"prefill": 0, "decode": 1}
        decode.close()


def in_flight(router_url: str, route: str) -> float:
    for line in httpx.get(router_url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(f'fsm_pd_router_requests_in_flight{{route="{route}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_router_started_before_its_decode_is_not_ready_and_holds_a_request_until_it_is():
    """Readiness (sgl-model-gateway's /readiness; /v1/models too, which clients wait for) is 503 while no decode
    node is up, /liveness 200; a chat that comes meanwhile waits for the decode's first 200 and is answered (it got
    a 503 "no healthy decode worker (... starting ...)" at once)."""
    port = free_port()
    prefill, decode = StubEngine(role="prefill"), StubEngine(role="decode")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    with AppServer(create_app(prefill, prefill.tokenizer, bootstrap_port=9000)) as p:
        router = create_router_app([(p.url, 9000)], [f"http://127.0.0.1:{port}"], pd_policy=CLASSIC_PD)
        with AppServer(router) as rs, concurrent.futures.ThreadPoolExecutor(1) as pool:
            assert httpx.get(rs.url + "/liveness", timeout=5).status_code == 200
            ready = httpx.get(rs.url + "/readiness", timeout=10)
            assert ready.status_code == 503 and ready.json()["ready"] == {"prefill": 1, "decode": 0}, ready.text
            assert "a ready decode worker" in ready.json()["waiting_for"][0] and "starting" in ready.text
            assert httpx.get(rs.url + "/v1/models", timeout=10).status_code == 503
            answer = pool.submit(httpx.post, rs.url + "/v1/chat/completions", json=chat, timeout=30)
            assert until(lambda: in_flight(rs.url, "/v1/chat/completions") == 1)  # the router holds it
            with AppServer(create_app(decode, decode.tokenizer), port=port):
                assert answer.result().status_code == 200, answer.result().text
                assert httpx.get(rs.url + "/readiness", timeout=5).status_code == 200
                assert httpx.get(rs.url + "/v1/models", timeout=5).json()["data"][0]["id"] == "stub-model"
    prefill.close()
    decode.close()


def test_decode_error_status_is_passed_through():
    decode = StubEngine(role="decode", fail_after=0)
    with pd_cluster([StubEngine(role="prefill")], [decode], retry=NO_RETRY) as (url, _, _):
        r = httpx.post(url + "/generate", json={"text": "a"}, timeout=10)
        assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"]


def test_logprobs_are_merged_prefill_first(pair):
    url, _, _ = pair
    r = httpx.post(url + "/generate", json={"text": "hey", "return_logprob": True,
                                            "sampling_params": {"max_new_tokens": 2}}, timeout=10)
    meta = r.json()["meta_info"]
    assert meta["input_token_logprobs"] == [[None, ord("h"), None], [PREFILL_LOGPROB, ord("e"), None],
                                            [PREFILL_LOGPROB, ord("y"), None]]
    assert [x[0] for x in meta["output_token_logprobs"]] == [DECODE_LOGPROB, DECODE_LOGPROB]


def test_logprobs_are_merged_into_every_streamed_chunk(pair):
    url, _, _ = pair
    r = httpx.post(url + "/generate", json={"text": "hey", "return_logprob": True, "stream": True,
                                            "sampling_params": {"max_new_tokens": 3}}, timeout=10)
    data = sse_data(r.text)
    assert data[-1] == "[DONE]" and len(data) == 4
    for chunk in map(json.loads, data[:-1]):
        assert [x[0] for x in chunk["meta_info"]["input_token_logprobs"]] == [None, PREFILL_LOGPROB, PREFILL_LOGPROB]


def test_stream_relays_decode_chunks(pair):
    url, _, _ = pair
    with httpx.stream("POST", url + "/generate", json={"text": "a", "stream": True,
                                                       "sampling_params": {"max_new_tokens": 4}}, timeout=10) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert [json.loads(d)["text"] for d in data[:-1]] == [" ", " h", " he", " hel"]


def test_openai_routes_go_through_the_router(pair):
    url, prefill, decode = pair
    chat = httpx.post(url + "/v1/chat/completions", json={"model": "stub-model", "max_tokens": 2,
                                                          "messages": [{"role": "user", "content": "hi"}]}, timeout=10)
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"] == " h"
    comp = httpx.post(url + "/v1/completions", json={"model": "stub-model", "prompt": "hi", "max_tokens": 2,
                                                     "stream": True}, timeout=10)
    assert "".join(json.loads(d)["choices"][0]["text"] for d in sse_data(comp.text)[:-1]) == " h"
    assert prefill.submitted[0].bootstrap == decode.submitted[0].bootstrap
    assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "stub-model"
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/health_generate", timeout=10).status_code == 200
    assert httpx.get(url + "/model_info").json()["model_path"] == "stub-model"


def test_round_robin_alternates_each_side():
    prefills = [StubEngine(role="prefill") for _ in range(2)]
    decodes = [StubEngine(role="decode") for _ in range(2)]
    with pd_cluster(prefills, decodes, ports=[9001, 9002]) as (url, _, _):
        for _ in range(4):
            assert httpx.post(url + "/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 1}},
                              timeout=10).status_code == 200
    assert [len(e.submitted) for e in prefills + decodes] == [2, 2, 2, 2]
    assert {r.bootstrap.port for r in prefills[1].submitted} == {9002}


def test_client_disconnect_at_the_router_aborts_both_legs():
    prefill = StubEngine(role="prefill", hang=True)
    decode = StubEngine(role="decode", hang=True)
    with pd_cluster([prefill], [decode]) as (url, _, _):
        host, port = url.removeprefix("http://").split(":")
        sock = socket.create_connection((host, int(port)))
        body = json.dumps({"text": "a"}).encode()
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        assert prefill.wait_submitted(1) and decode.wait_submitted(1)
        sock.close()
        assert until(lambda: prefill.aborted and decode.aborted), (prefill.aborted, decode.aborted)


def test_router_api_key_is_required_and_forwarded():
    prefill, decode = StubEngine(role="prefill"), StubEngine(role="decode")
    with contextlib.ExitStack() as stack:
        p = stack.enter_context(AppServer(create_app(prefill, prefill.tokenizer, api_key="k", bootstrap_port=1)))
        d = stack.enter_context(AppServer(create_app(decode, decode.tokenizer, api_key="k")))
        rs = stack.enter_context(AppServer(create_router_app([(p.url, 1)], [d.url], api_key="k", pd_policy=CLASSIC_PD)))
        assert httpx.post(rs.url + "/generate", json={"text": "a"}, timeout=10).status_code == 401
        ok = httpx.post(rs.url + "/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 1}},
                        headers={"Authorization": "Bearer k"}, timeout=10)
        assert ok.status_code == 200


def test_router_malformed_json_is_400():
    with pd_cluster([StubEngine(role="prefill")], [StubEngine(role="decode")]) as (url, _, _):
        r = httpx.post(url + "/generate", content=b"{oops", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]


def test_cli_flags_parse_like_sglang_router():
    args = build_arg_parser().parse_args([
        "--pd-disaggregation", "--prefill", "http://p1:30000", "8998", "--prefill", "http://p2:30000", "none",
        "--prefill", "http://p3:30000", "--decode", "http://d1:30001", "--decode", "http://d2:30001",
        "--policy", "random"])
    assert parse_prefill_specs(args.prefill) == [PrefillWorker("http://p1:30000", 8998),
                                                 PrefillWorker("http://p2:30000", None),
                                                 PrefillWorker("http://p3:30000", None)]
    assert args.decode == ["http://d1:30001", "http://d2:30001"] and args.policy == "random"
    assert args.host == "127.0.0.1"
    with pytest.raises(ValueError):
        parse_prefill_specs([["http://p:1", "eighty"]])


def test_router_survives_concurrent_load(pair):
    url, prefill, decode = pair
    results = []

    def call(i):
        results.append(httpx.post(url + "/generate", json={"text": f"n{i}", "sampling_params": {"max_new_tokens": 2}},
                                  timeout=20).status_code)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == [200] * 16
    assert {r.bootstrap.room for r in prefill.submitted} == {r.bootstrap.room for r in decode.submitted}


class HeldPrefill(StubEngine):
    """A prefill whose answer waits for ``release``: the decode's stream runs meanwhile (its node has the KV)."""

    def __init__(self, **kw):
        super().__init__(role="prefill", **kw)
        self.release = threading.Event()
        self.released_at: float | None = None

    def _prefill(self, request, stream, stop):
        self.release.wait(20)
        self.released_at = time.monotonic()
        super()._prefill(request, stream, stop)


def first_chunk_at(url: str, body: dict, prefill: HeldPrefill, release_after_s: float | None) -> tuple[float, str]:
    """When the client got its first streamed chunk, and the whole text; ``release_after_s``: free the prefill's
    answer that long after the request went out (None: once the whole stream came)."""
    if release_after_s is not None:
        threading.Timer(release_after_s, prefill.release.set).start()
    first, text = None, ""
    with httpx.stream("POST", url + "/generate", json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if first is None and line.startswith("data: ") and line != "data: [DONE]":
                first = time.monotonic()
            text += line + "\n"
    prefill.release.set()
    return first, text


def test_a_decode_stream_is_relayed_before_the_prefill_answers():
    """A decode node's stream starts with its first token, so it has the KV: the router relays it without waiting
    for the prefill's answer, which only counts for the prefill's load and breaker once it comes. Only a
    /generate with return_logprob (the prefill's prompt logprobs go into the answer) waits for it."""
    prefill, decode = HeldPrefill(), StubEngine(role="decode")
    with pd_cluster([prefill], [decode], retry=NO_RETRY) as (url, p_urls, _):
        body = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 3}}
        first, text = first_chunk_at(url, body, prefill, None)
        assert until(lambda: prefill.released_at is not None)
        assert first < prefill.released_at, "the stream waited for the prefill"
        assert "data: [DONE]" in text and '"error"' not in text
        # the stream's end did not cut the prefill's call short (a disconnect would abort its room there)
        assert until(lambda: all(w["outstanding"] == 0 for w in httpx.get(url + "/server_info").json()["prefill"]))
        assert prefill.aborted == []

        prefill.release.clear()
        prefill.released_at = None
        first, text = first_chunk_at(url, {**body, "return_logprob": True}, prefill, 0.5)
        assert first > prefill.released_at, "the prompt logprobs of the prefill's answer were not waited for"
        assert "input_token_logprobs" in text


def test_a_stopped_router_stops_its_health_checks_and_closes_its_client():
    prefill, decode = StubEngine(role="prefill"), StubEngine(role="decode")
    with pd_cluster([prefill], [decode]) as (_, p_urls, d_urls):
        app = create_router_app([(p_urls[0], 9000)], d_urls, pd_policy=CLASSIC_PD)
        pd = app.state.router
        with AppServer(app) as rs:
            checked_by(rs.url)  # the health checks run, on the server's loop
            task = pd._health_task
            assert task is not None and not task.done() and pd._client is not None
        assert task.cancelled() and pd._client is None
