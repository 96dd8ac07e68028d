"""Failure paths over real sockets: malformed bodies, engine errors, client disconnects, the API key."""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from polling import until
from real_parts import TCP
from stub_engine import stub_server

from fsm_pd.serving.types import EngineError


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("content, headers, fragment", [
    (b"{not json", {"content-type": "application/json"}, "malformed JSON"),
    (b"[1, 2]", {"content-type": "application/json"}, "JSON object"),
    (b"", {"content-type": "application/json"}, "JSON body is required"),
    (b'{"text": "a"}', {}, "JSON object"),
])
@TCP
def test_malformed_bodies_are_400_with_a_message(path, content, headers, fragment):
    with stub_server() as (url, engine):
        r = httpx.post(url + path, content=content, headers=headers)
        assert r.status_code == 400, r.text
        assert fragment in r.json()["error"]["message"]


@TCP
def test_unknown_route_and_wrong_method_are_4xx_json():
    with stub_server() as (url, _):
        assert httpx.get(url + "/nope").status_code == 404
        r = httpx.get(url + "/generate")
        assert r.status_code == 405 and "error" in r.json()


@TCP
def test_engine_refusal_at_submit_keeps_its_status():
    with stub_server(submit_error=EngineError("no pages for this one", 503)) as (url, _):
        r = httpx.post(url + "/generate", json={"text": "a"})
        assert r.status_code == 503 and r.json()["error"]["message"] == "no pages for this one"


@pytest.mark.parametrize("stream", [False, True])
@TCP
def test_engine_failure_before_the_first_token_is_an_http_error(stream):
    with stub_server(fail_after=0) as (url, _):
        r = httpx.post(url + "/generate", json={"text": "a", "stream": stream})
        assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"]


@TCP
def test_engine_failure_mid_stream_is_an_error_event_then_done():
    with stub_server(fail_after=2) as (url, _):
        r = httpx.post(url + "/generate", json={"text": "a", "stream": True})
        assert r.status_code == 200
        data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        assert json.loads(data[-2])["error"]["message"] == "stub engine: injected failure"
        assert len(data) == 4  # two tokens, the error, [DONE]


def _raw_post(url: str, path: str, body: dict) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    payload = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def _read_until(sock: socket.socket, marker: bytes, timeout_s: float = 10.0) -> bytes:
    sock.settimeout(timeout_s)
    got = b""
    while marker not in got and (chunk := sock.recv(4096)):
        got += chunk
    return got


def counted(url: str, status: str, route: str = "/generate") -> float:
    """Requests the API counted as answered: its middleware counts one once the handler and its response are done."""
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f'fsm_pd_http_requests_total{{route="{route}",status="{status}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("path, body", [
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 400}}),
    ("/generate", {"text": "a", "stream": True, "sampling_params": {"max_new_tokens": 400}}),
    ("/v1/completions", {"model": "stub-model", "prompt": "a", "max_tokens": 400}),
    ("/v1/chat/completions", {"model": "stub-model", "messages": [{"role": "user", "content": "a"}],
                              "max_tokens": 400, "stream": True}),
])
@TCP
def test_client_disconnect_aborts_the_request(path, body):
    with stub_server(token_delay_s=0.05) as (url, engine):
        sock = _raw_post(url, path, body)
        assert engine.wait_submitted(1)
        if body.get("stream"):  # cut it mid-stream, after its headers and first token: not before the headers
            assert b"data: " in _read_until(sock, b"data: ")
        sock.close()
        rid = engine.submitted[0].rid
        assert until(lambda: rid in engine.aborted), "the request was not aborted"
        assert engine.live == []


@TCP
def test_client_disconnect_while_the_engine_is_silent_aborts():
    with stub_server(hang=True) as (url, engine):
        sock = _raw_post(url, "/generate", {"text": "a", "stream": True})
        assert engine.wait_submitted(1)
        sock.close()
        assert until(lambda: engine.aborted == [engine.submitted[0].rid])


@TCP
def test_finished_requests_are_not_aborted():
    with stub_server() as (url, engine):
        for stream in (False, True):
            assert httpx.post(url + "/generate", json={"text": "a", "stream": stream}).status_code == 200
        # a handler closes its run before its response ends, and is counted once it returned: both runs closed by then
        assert until(lambda: counted(url, "200") == 2)
        assert engine.aborted == []


@TCP
def test_api_key_guards_everything_but_health_and_metrics():
    with stub_server(api_key="sekrit") as (url, _):
        assert httpx.post(url + "/generate", json={"text": "a"}).status_code == 401
        wrong = httpx.post(url + "/generate", json={"text": "a"}, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and "API key" in wrong.json()["error"]["message"]
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/server_info").status_code == 401
        ok = {"Authorization": "Bearer sekrit"}
        assert httpx.post(url + "/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 1}},
                          headers=ok).status_code == 200
        assert httpx.get(url + "/server_info", headers=ok).status_code == 200
        for open_path in ("/health", "/health_generate", "/metrics"):
            assert httpx.get(url + open_path, timeout=10).status_code == 200


@TCP
def test_openapi_schema_describes_the_bodies():
    with stub_server() as (url, _):
        schema = httpx.get(url + "/openapi.json").json()
    props = schema["components"]["schemas"]["GenerateBody"]["properties"]
    assert {"text", "input_ids", "sampling_params", "stream", "return_logprob", "bootstrap_room"} <= set(props)
    assert "400" in schema["paths"]["/v1/chat/completions"]["post"]["responses"]


def test_a_request_the_engine_failed_never_aborts_a_later_one_with_its_rid():
    # A router's retry reaches the same node with the client's rid while the failed attempt's handler is still
    # winding down: closing the failed run must leave the new one running (the engine already forgot the old).
    import asyncio

    from stub_engine import StubEngine

    from fsm_pd.api.runner import RequestRun
    from fsm_pd.serving.types import GenerateRequest, SamplingParams

    engine, live = StubEngine(fail_after=0, token_delay_s=0.05), {}

    def request() -> GenerateRequest:
        return GenerateRequest(rid="client-1", input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=50), seed=0)

    async def scenario() -> None:
        failed = RequestRun(engine, request(), engine.tokenizer, None, live)
        with pytest.raises(EngineError):
            await failed.next_output()
        engine.fail_after = None
        retry = RequestRun(engine, request(), engine.tokenizer, None, live)
        failed.close()
        assert engine.live == ["client-1"] and live[("client-1", None)] is retry
        assert (await retry.next_output()) is not None
        retry.close()

    asyncio.run(scenario())
