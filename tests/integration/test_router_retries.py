"""The built-in router's retries and migrations in front of stub workers, over real sockets on 127.0.0.1: a failed
attempt is tried again on another pair with a new room and the same rid (the old legs aborted first), within the
request's tries and the router's budget; a ``/generate`` stream whose decode breaks off continues on another decode
with prompt + the tokens already sent."""

from __future__ import annotations

import contextlib
import json

import httpx
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from polling import until
from test_router import pd_cluster, sse_data
from test_router_failures import SSE_HEAD, chunk, scripted_worker

from fsm_pd.api import AppServer, StubEngine, create_app, create_router_app
from fsm_pd.api.router import RetrySettings


def counter(url: str, name: str) -> dict[str, float]:
    found = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            labels, _, value = line.rpartition(" ")
            found[labels[len(name):]] = float(value)
    return found


def test_a_failed_prefill_is_retried_on_the_other_with_a_new_room_and_the_same_rid():
    broken, good = StubEngine(role="prefill", fail_after=0), StubEngine(role="prefill")
    decode = StubEngine(role="decode", token_delay_s=0.01)
    with pd_cluster([broken, good], [decode], ports=[9001, 9002]) as (url, _, _):
        r = httpx.post(url + "/generate", json={"text": "hi", "rid": "client-1",
                                                "sampling_params": {"max_new_tokens": 3}}, timeout=20)
        assert r.status_code == 200 and r.json()["text"] == " he", r.text
        assert [q.rid for q in broken.submitted + good.submitted] == ["client-1", "client-1"]
        first, second = broken.submitted[0].bootstrap, good.submitted[0].bootstrap
        assert first.room != second.room and (first.port, second.port) == (9001, 9002)
        # the decode got both attempts, the first one aborted before the second came
        assert [q.bootstrap.room for q in decode.submitted] == [first.room, second.room]
        assert decode.aborted[:1] == ["client-1"]
        assert counter(url, "fsm_pd_router_retries_total") == {'{reason="prefill_500"}': 1.0}


def test_retry_policy_fail_gives_the_first_failure():
    broken, good = StubEngine(role="prefill", fail_after=0), StubEngine(role="prefill")
    with pd_cluster([broken, good], [StubEngine(role="decode")], ports=[9001, 9002],
                    retry=RetrySettings(policy="fail")) as (url, _, _):
        r = httpx.post(url + "/generate", json={"text": "hi"}, timeout=20)
        assert r.status_code == 500 and r.json()["error"]["message"] == "stub prefill: injected KV transfer failure"
        assert good.submitted == []


def test_retries_are_bounded_per_request_then_503_with_the_reason():
    prefills = [StubEngine(role="prefill", fail_after=0) for _ in range(2)]
    with pd_cluster(prefills, [StubEngine(role="decode")], ports=[9001, 9002],
                    retry=RetrySettings(max_retries=2)) as (url, _, _):
        r = httpx.post(url + "/generate", json={"text": "hi"}, timeout=20)
        assert r.status_code == 503
        error = r.json()["error"]
        assert error["code"] == "retries_exhausted" and "after 3 attempts" in error["message"]
        assert "injected KV transfer failure" in error["message"]
        assert sum(len(p.submitted) for p in prefills) == 3
        assert counter(url, "fsm_pd_router_failover_refused_total") == {'{reason="retries_exhausted"}': 1.0}


def test_the_retry_budget_bounds_retries_across_requests():
    prefills = [StubEngine(role="prefill", fail_after=0) for _ in range(2)]
    budget = RetrySettings(max_retries=5, budget_ratio=0.0, budget_min_per_s=0.1, budget_window_s=10.0)  # 1 retry
    with pd_cluster(prefills, [StubEngine(role="decode")], ports=[9001, 9002], retry=budget) as (url, _, _):
        first = httpx.post(url + "/generate", json={"text": "hi"}, timeout=20)
        second = httpx.post(url + "/generate", json={"text": "hi"}, timeout=20)
        assert first.json()["error"]["code"] == second.json()["error"]["code"] == "retry_budget_exhausted"
        assert first.status_code == second.status_code == 503
        assert "1 retries in the last 10 s" in second.json()["error"]["message"]
        assert sum(len(p.submitted) for p in prefills) == 3  # 2 attempts, then 1: the budget had one retry


def test_a_4xx_is_not_retried():
    refusing = StubEngine(role="prefill", max_context=4)
    good = StubEngine(role="prefill")
    with pd_cluster([refusing, good], [StubEngine(role="decode")], ports=[9001, 9002]) as (url, _, _):
        r = httpx.post(url + "/generate", json={"text": "a long prompt"}, timeout=20)
        assert r.status_code == 400 and good.submitted == []


def test_a_broken_generate_stream_continues_on_another_decode():
    def event(ids: list[int], text: str) -> bytes:
        doc = {"text": text, "output_ids": ids, "meta_info": {"id": "x", "finish_reason": None,
                                                              "prompt_tokens": 2, "completion_tokens": len(ids)}}
        return b"data: " + json.dumps(doc).encode() + b"\n\n"

    reply = SSE_HEAD + chunk(event([104], "h")) + chunk(event([104, 105], "hi"))  # then the connection drops
    prefill, decode = StubEngine(role="prefill"), StubEngine(role="decode")
    with contextlib.ExitStack() as stack:
        dying = stack.enter_context(scripted_worker(reply, then_close=True))
        p = stack.enter_context(AppServer(create_app(prefill, prefill.tokenizer, bootstrap_port=9000)))
        d = stack.enter_context(AppServer(create_app(decode, decode.tokenizer)))
        router = stack.enter_context(AppServer(create_router_app([(p.url, 9000)], [dying, d.url])))
        body = {"text": "hi", "stream": True, "rid": "s-1",
                "sampling_params": {"max_new_tokens": 5, "temperature": 0}}
        r = httpx.post(router.url + "/generate", json=body, timeout=20)
        events = [json.loads(x) for x in sse_data(r.text)[:-1]]
        assert sse_data(r.text)[-1] == "[DONE]" and all("error" not in e for e in events), r.text
        moved = decode.submitted[0]
        prompt = prefill.tokenizer.encode("hi")
        assert moved.rid == "s-1" and moved.input_ids == prompt + [104, 105]
        assert moved.sampling.max_new_tokens == 3
        last = events[-1]
        assert last["output_ids"][:2] == [104, 105] and len(last["output_ids"]) == 5
        assert last["text"].startswith("hi") and last["meta_info"]["completion_tokens"] == 5
        assert last["meta_info"]["prompt_tokens"] == len(prompt)
        assert [e["output_ids"][:2] for e in events[2:]] == [[104, 105]] * (len(events) - 2)  # no token twice
        assert counter(router.url, "fsm_pd_router_migrations_total") == {'{reason="decode_stream_broken"}': 1.0}
    prefill.close()
    decode.close()


def draining_node() -> FastAPI:
    """A decode node in drain, as the router's health checks see it: /health 503 ``{"status": "draining"}``."""
    app = FastAPI()
    app.add_api_route("/health", lambda: JSONResponse({"status": "draining"}, status_code=503), methods=["GET"])
    return app


def test_a_worker_whose_health_says_draining_gets_no_new_requests():
    good, prefill = StubEngine(role="decode"), StubEngine(role="prefill")
    with contextlib.ExitStack() as stack:
        p = stack.enter_context(AppServer(create_app(prefill, prefill.tokenizer, bootstrap_port=9000)))
        drained = stack.enter_context(AppServer(draining_node()))
        d_good = stack.enter_context(AppServer(create_app(good, good.tokenizer)))
        app = create_router_app([(p.url, 9000)], [drained.url, d_good.url], health_interval_s=0.1)
        router = stack.enter_context(AppServer(app))
        httpx.get(router.url + "/health", timeout=5)  # the first call starts the health checks
        assert until(lambda: httpx.get(router.url + "/health", timeout=5).json()["admitted"]["decode"] == 1)
        for _ in range(4):
            assert httpx.post(router.url + "/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 1}},
                              timeout=10).status_code == 200
        assert len(good.submitted) == 4
        info = httpx.get(router.url + "/server_info", timeout=5).json()
        assert not info["decode"][0]["admitted"] and info["decode"][0]["reason"].startswith("draining")
        assert counter(router.url, "fsm_pd_router_worker_ejections_total") == \
            {'{reason="draining",role="decode"}': 1.0}
    good.close()
    prefill.close()
