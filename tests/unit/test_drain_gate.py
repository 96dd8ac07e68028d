"""The drain of one node's HTTP server (``api/drain.py``) over the stub engine, in process on 127.0.0.1: ``POST
/drain`` refuses new generation requests (503, code draining) and answers ``/health`` 503 draining; an open request
that ends within ``drain_timeout_s`` is answered as usual, one that does not is aborted with a 503 naming the drain;
the drain then reports itself finished (the CLI's server stops there). The SIGTERM path on real processes:
``tests/integration/test_drain.py``."""

from __future__ import annotations

import threading
import time

import httpx
from real_parts import TCP
from stub_engine import StubEngine

from fsm_pd.api import AppServer, create_app

pytestmark = TCP  # every test here serves or connects on 127.0.0.1 (tests/real_parts.py)

BODY = {"text": "hi", "sampling_params": {"max_new_tokens": 8}}


def post_in_background(url: str, results: list) -> threading.Thread:
    thread = threading.Thread(target=lambda: results.append(httpx.post(url + "/generate", json=BODY, timeout=30)))
    thread.start()
    return thread


def test_drain_refuses_new_work_and_aborts_what_outlives_its_bound():
    engine = StubEngine(hang=True)
    app = create_app(engine, engine.tokenizer, drain_timeout_s=0.5)
    drain = app.state.drain
    with AppServer(app) as server:
        results: list = []
        waiting = post_in_background(server.url, results)
        assert engine.wait_submitted(1)
        answer = httpx.post(server.url + "/drain", timeout=10)
        assert answer.status_code == 202 and answer.json()["status"] == "draining" and answer.json()["in_flight"] == 1
        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        refused = httpx.post(server.url + "/v1/completions", json={"model": "stub-model", "prompt": "x"}, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        assert refused.headers["retry-after"] == "1"
        assert httpx.get(server.url + "/server_info", timeout=10).status_code == 200  # info routes still answer
        assert drain.finished.wait(10)
        waiting.join(10)
        assert results[0].status_code == 503 and "drain timeout of 0.5 s" in results[0].json()["error"]["message"]
        assert drain.aborted == 1 and httpx.post(server.url + "/drain", timeout=10).status_code == 202  # idempotent
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        assert 'fsm_pd_drains_total{trigger="admin"} 1.0' in metrics
        assert "fsm_pd_drain_aborted_requests_total 1.0" in metrics


def test_a_request_that_ends_within_the_bound_is_answered():
    engine = StubEngine(token_delay_s=0.1)  # 8 tokens: about 0.8 s
    app = create_app(engine, engine.tokenizer, drain_timeout_s=20)
    drain = app.state.drain
    with AppServer(app) as server:
        results: list = []
        waiting = post_in_background(server.url, results)
        assert engine.wait_submitted(1)
        started = time.monotonic()
        drain.begin("admin")
        assert drain.finished.wait(20)
        waiting.join(10)
        assert results[0].status_code == 200 and len(results[0].json()["output_ids"]) == 8
        assert drain.aborted == 0 and time.monotonic() - started < 10
