"""Health, info, metrics and abort routes over real sockets: the fields sglang-router reads when it registers."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter
from real_parts import TCP
from stub_engine import StubEngine, stub_server

from fsm_pd.api import AppServer, create_app
from fsm_pd.store.causes import ABORT_BY_NAME, RETRY_ABORT

pytestmark = TCP  # every test here serves or connects on 127.0.0.1 (tests/real_parts.py)


def test_health_is_200_and_503_when_the_engine_says_unhealthy():
    with stub_server() as (url, engine):
        assert httpx.get(url + "/health").status_code == 200
        engine.healthy = False
        assert httpx.get(url + "/health").status_code == 503


def test_health_generate_runs_one_token_on_a_colocated_node():
    with stub_server() as (url, engine):
        assert httpx.get(url + "/health_generate", timeout=10).status_code == 200
        assert [r.sampling.max_new_tokens for r in engine.submitted] == [1]


def test_health_generate_on_a_colocated_node_fails_with_the_engine():
    with stub_server(fail_after=0) as (url, _):
        r = httpx.get(url + "/health_generate", timeout=10)
        assert r.status_code == 503 and "injected failure" in r.json()["reason"]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_health_generate_on_pd_nodes_checks_the_engine_without_generating(role):
    with stub_server(role, bootstrap_port=8998) as (url, engine):
        assert httpx.get(url + "/health_generate", timeout=10).status_code == 200
        assert engine.submitted == []


def test_health_generate_times_out_to_503():
    engine = StubEngine(hang=True)
    with AppServer(create_app(engine, engine.tokenizer, health_timeout_s=0.3)) as server:
        r = httpx.get(server.url + "/health_generate", timeout=10)
        assert r.status_code == 503 and "within 0.3s" in r.json()["reason"]
        assert len(engine.aborted) == 1  # the probe's request was not left running


@pytest.mark.parametrize("path", ["/server_info", "/get_server_info"])
def test_server_info_has_the_fields_the_router_reads(path):
    with stub_server("prefill", bootstrap_port=8998) as (url, _):
        info = httpx.get(url + path).json()
    assert info["model_path"] == info["served_model_name"] == "stub-model"
    assert (info["tp_size"], info["dp_size"]) == (1, 1)
    assert info["disaggregation_mode"] == "prefill" and info["disaggregation_bootstrap_port"] == 8998
    assert info["internal_states"][0]["role"] == "prefill"


def test_server_info_of_colocated_reports_null_mode():
    with stub_server() as (url, _):
        assert httpx.get(url + "/server_info").json()["disaggregation_mode"] == "null"


@pytest.mark.parametrize("path", ["/model_info", "/get_model_info"])
def test_model_info(path):
    engine = StubEngine()
    app = create_app(engine, engine.tokenizer, model_name="served", model_path="/models/x",
                     model_info={"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    with AppServer(app) as server:
        info = httpx.get(server.url + path).json()
        # the model path is also accepted as a model name
        r = httpx.post(server.url + "/v1/completions", json={"model": "/models/x", "prompt": "a", "max_tokens": 1})
    assert info["model_path"] == "/models/x" and info["is_generation"] is True
    assert info["model_type"] == "llama" and info["architectures"] == ["LlamaForCausalLM"]
    assert r.status_code == 200 and r.json()["model"] == "served"


def test_metrics_exposes_engine_registries_and_request_counts():
    registry = CollectorRegistry()
    Counter("stub_engine_things", "things", registry=registry).inc(3)
    engine = StubEngine()
    with AppServer(create_app(engine, engine.tokenizer, registries=[registry])) as server:
        httpx.post(server.url + "/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 1}})
        httpx.post(server.url + "/generate", json={"text": ""})
        httpx.get(server.url + "/no/such/route")
        text = httpx.get(server.url + "/metrics").text
    assert "stub_engine_things_total 3.0" in text
    assert 'fsm_pd_http_requests_total{route="/generate",status="200"} 1.0' in text
    assert 'fsm_pd_http_requests_total{route="/generate",status="400"} 1.0' in text
    assert 'route="other",status="404"' in text


def test_metrics_default_to_the_engines_registries_attribute():
    registry = CollectorRegistry()
    Counter("from_engine_attr", "x", registry=registry).inc()
    engine = StubEngine()
    engine.registries = [registry]
    with AppServer(create_app(engine, engine.tokenizer)) as server:
        assert "from_engine_attr_total 1.0" in httpx.get(server.url + "/metrics").text


def test_abort_request_stops_a_running_request():
    with stub_server(token_delay_s=0.05) as (url, engine):
        result = {}

        def call():
            result["r"] = httpx.post(url + "/generate", json={"text": "a", "rid": "long-1",
                                                              "sampling_params": {"max_new_tokens": 400}}, timeout=20)

        worker = threading.Thread(target=call)
        worker.start()
        assert engine.wait_submitted(1)
        r = httpx.post(url + "/abort_request", json={"rid": "long-1"})
        worker.join(10)
        assert r.status_code == 200 and r.json() == {"aborted": ["long-1"]}
        assert result["r"].status_code == 499 and "aborted" in result["r"].json()["error"]["message"]
        assert httpx.post(url + "/abort_request", json={"rid": "unknown"}).json() == {"aborted": []}


def test_abort_all_aborts_every_live_request():
    with stub_server(hang=True) as (url, engine):
        threads = [threading.Thread(target=httpx.post, args=(url + "/generate",),
                                    kwargs={"json": {"text": "a"}, "timeout": 20}) for _ in range(3)]
        for t in threads:
            t.start()
        assert engine.wait_submitted(3)
        deadline = time.monotonic() + 5
        while len(engine.live) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        aborted = httpx.post(url + "/abort_request", json={"abort_all": True}).json()["aborted"]
        for t in threads:
            t.join(10)
        assert sorted(aborted) == sorted(r.rid for r in engine.submitted)


def pd_body(rid: str, room: int, **extra) -> dict:
    return {"text": "a", "rid": rid, "bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": room,
            **extra}


def post_in_background(url: str, body: dict) -> tuple[threading.Thread, dict]:
    result: dict = {}
    worker = threading.Thread(target=lambda: result.setdefault("r", httpx.post(url + "/generate", json=body,
                                                                               timeout=20)))
    worker.start()
    return worker, result


def test_abort_request_with_a_room_stops_that_attempt_only_and_without_one_every_attempt():
    with stub_server("decode", bootstrap_port=8998, hang=True) as (url, engine):
        first, first_result = post_in_background(url, pd_body("twice", 11))
        assert engine.wait_submitted(1)
        retry, retry_result = post_in_background(url, pd_body("twice", 12))  # the same rid, a new room
        assert engine.wait_submitted(2)
        aborted = httpx.post(url + "/abort_request", json={"rid": "twice", "room": 11}).json()
        first.join(10)
        assert aborted == {"aborted": ["twice"]} and first_result["r"].status_code == 499
        assert engine.live == ["twice"] and not retry_result  # the retry runs on
        # SGLang's abort (what sglang-router sends): every live request of the rid
        assert httpx.post(url + "/abort_request", json={"rid": "twice"}).json() == {"aborted": ["twice"]}
        retry.join(10)
        assert retry_result["r"].status_code == 499 and engine.live == []
        # journaled as what each is: the router's wind-down of an attempt it retries, a client's own abort by name
        assert engine.abort_reasons == [RETRY_ABORT, ABORT_BY_NAME]


def test_an_abort_with_a_room_before_its_request_refuses_it_with_every_copy():
    with stub_server("prefill", bootstrap_port=8998) as (url, engine):
        early = httpx.post(url + "/abort_request", json={"rid": "late", "room": 21})
        assert early.status_code == 200 and early.json() == {"aborted": []}
        body = pd_body("late", 21, sampling_params={"n": 2, "max_new_tokens": 2})
        late = httpx.post(url + "/generate", json=body, timeout=20)
        assert late.status_code == 499 and "aborted before it arrived" in late.json()["error"]["message"]
        assert engine.submitted == []  # copy 0 keeps the room and goes first: neither copy ran
        retry = httpx.post(url + "/generate", json={**body, "bootstrap_room": 22}, timeout=20)
        assert retry.status_code == 200 and len(retry.json()) == 2


def test_a_colocated_node_ignores_the_room_of_an_abort():
    with stub_server(hang=True) as (url, engine):
        worker, result = post_in_background(url, {"text": "a", "rid": "solo"})
        assert engine.wait_submitted(1)
        assert httpx.post(url + "/abort_request", json={"rid": "solo", "room": 5}).json() == {"aborted": ["solo"]}
        worker.join(10)
        assert result["r"].status_code == 499
