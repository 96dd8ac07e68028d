"""The built-in router's retries and migrations in front of stub workers, over real sockets on 127.0.0.1: a failed
attempt is tried again on another pair with a new room and the same rid (the old legs aborted first), within the
request's tries and the router's budget; a stream whose decode breaks off continues on another pair from the tokens
its chunks carried (``fsm_pd_resume``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from polling import until
from raw_worker import raw_worker
from stub_engine import StubEngine
from test_router import pd_cluster, sse_data
from test_router_failures import SSE_HEAD, chunk

from fsm_pd.api import AppServer, create_app
from fsm_pd.api.streaming import PROGRESS_HEADER
from fsm_pd.router import create_router_app
from fsm_pd.router.app import RetrySettings
from fsm_pd.router.policy import CLASSIC_PD
from fsm_pd.serving.types import EngineError


def counter(url: str, name: str) -> dict[str, float]:
    found = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            labels, _, value = line.rpartition(" ")
            found[labels[len(name):]] = float(value)
    return found


def kv_waiting_decode() -> StubEngine:
    """A decode node as a real one behaves beside a prefill that fails: its first token, let alone a whole answer,
    comes only once the KV did, so after the prefill's failure (a stub decode answers at once; a whole answer that
    came first would be the client's, ``legs._both_answered``)."""
    return StubEngine(role="decode", token_delay_s=0.05)


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
    with pd_cluster([broken, good], [kv_waiting_decode()], ports=[9001, 9002],
                    retry=RetrySettings(policy="fail")) as (url, _, _):
        r = httpx.post(url + "/generate", json={"text": "hi"}, timeout=20)
        assert r.status_code == 500 and r.json()["error"]["message"] == "stub prefill: injected KV transfer failure"
        assert good.submitted == []


def test_retries_are_bounded_per_request_then_503_with_the_reason():
    prefills = [StubEngine(role="prefill", fail_after=0) for _ in range(2)]
    with pd_cluster(prefills, [kv_waiting_decode()], ports=[9001, 9002],
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
    with pd_cluster(prefills, [kv_waiting_decode()], ports=[9001, 9002], retry=budget) as (url, _, _):
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


def migrated(reply: bytes, path: str, body: dict) -> tuple[httpx.Response, StubEngine, str]:
    """``body`` through the router to a decode that sends ``reply`` and drops the connection, and a stub decode:
    (the client's answer, the stub decode that took the stream over, the router's migration counter)."""
    prefill, decode = StubEngine(role="prefill"), StubEngine(role="decode")
    with contextlib.ExitStack() as stack:
        dying = stack.enter_context(raw_worker(reply, then_close=True)).url
        p = stack.enter_context(AppServer(create_app(prefill, prefill.tokenizer, bootstrap_port=9000)))
        d = stack.enter_context(AppServer(create_app(decode, decode.tokenizer)))
        router = stack.enter_context(AppServer(create_router_app([(p.url, 9000)], [dying, d.url],
                                                                 pd_policy=CLASSIC_PD)))
        r = httpx.post(router.url + path, json=body, timeout=20)
        migrations = counter(router.url, "fsm_pd_router_migrations_total")
    prefill.close()
    decode.close()
    assert migrations == {'{reason="decode_stream_broken"}': 1.0}
    assert "fsm_pd_progress" not in r.text and sse_data(r.text)[-1] == "[DONE]", r.text
    return r, decode, prefill.tokenizer


def sse_event(doc: dict, ids: list[int]) -> bytes:
    """An event as a node sends it to a router that asked for progress."""
    return chunk(b"data: " + json.dumps({**doc, "fsm_pd_progress": {"ids": ids, "seed": 11}}).encode() + b"\n\n")


def test_with_migration_off_a_broken_stream_ends_with_its_error_and_the_decode_is_not_asked_for_progress():
    """``RetrySettings(migrate=False)`` (``--role pd``'s router: its one decode engine has no other to move to): the
    router relays the decode's bytes as they come, so it asks for no progress field and moves nothing."""
    prefill, decode = StubEngine(role="prefill"), StubEngine(role="decode")
    reply = SSE_HEAD + chunk(b'data: {"text": "h", "output_ids": [104], "meta_info": {"finish_reason": null}}\n\n')
    body = {"text": "hi", "stream": True, "rid": "s-0", "sampling_params": {"max_new_tokens": 5, "temperature": 0}}
    with contextlib.ExitStack() as stack:
        dying = stack.enter_context(raw_worker(reply, then_close=True))
        p = stack.enter_context(AppServer(create_app(prefill, prefill.tokenizer, bootstrap_port=9000)))
        d = stack.enter_context(AppServer(create_app(decode, decode.tokenizer)))
        router = stack.enter_context(AppServer(create_router_app(
            [(p.url, 9000)], [dying.url, d.url], pd_policy=CLASSIC_PD, retry=RetrySettings(migrate=False))))
        r = httpx.post(router.url + "/generate", json=body, timeout=20)
        migrations = counter(router.url, "fsm_pd_router_migrations_total")
        # the stream the dying decode began, byte for byte, then the router's error and [DONE]
        events = sse_data(r.text)
        assert migrations == {} and decode.submitted == [] and len(dying.requests) == 1, (migrations, r.text)
        assert events[0] == '{"text": "h", "output_ids": [104], "meta_info": {"finish_reason": null}}', r.text
        assert json.loads(events[1])["error"]["code"] == 502 and events[-1] == "[DONE]", r.text
    prefill.close()
    decode.close()
    assert PROGRESS_HEADER.lower().encode() not in dying.requests_heads[0].lower(), dying.requests_heads[0]


def test_a_broken_generate_stream_continues_on_another_decode():
    def event(ids: list[int], text: str) -> dict:
        return {"text": text, "output_ids": ids, "meta_info": {"id": "x", "finish_reason": None,
                                                               "prompt_tokens": 2, "completion_tokens": len(ids)}}

    reply = SSE_HEAD + sse_event(event([104], "h"), [104]) + sse_event(event([104, 105], "hi"), [105])  # then drops
    body = {"text": "hi", "stream": True, "rid": "s-1", "sampling_params": {"max_new_tokens": 5, "temperature": 0}}
    r, decode, tokenizer = migrated(reply, "/generate", body)
    events = [json.loads(x) for x in sse_data(r.text)[:-1]]
    assert all("error" not in e for e in events), r.text
    moved = decode.submitted[0]
    prompt = tokenizer.encode("hi")
    assert moved.rid == "s-1" and moved.input_ids == prompt + [104, 105] and moved.generated_before == [104, 105]
    assert moved.sampling.max_new_tokens == 3 and moved.seed == 11  # the failed node's seed goes on
    last = events[-1]
    assert last["output_ids"][:2] == [104, 105] and len(last["output_ids"]) == 5
    assert last["text"] == tokenizer.decode(last["output_ids"]) and last["meta_info"]["completion_tokens"] == 5
    assert last["meta_info"]["prompt_tokens"] == len(prompt)
    assert [e["output_ids"][:2] for e in events[2:]] == [[104, 105]] * (len(events) - 2)  # no token twice


def test_a_broken_chat_stream_continues_with_one_role_chunk_and_every_token_once():
    def event(delta: dict) -> dict:
        return {"id": "chatcmpl-c-1", "object": "chat.completion.chunk", "model": "stub",
                "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}

    head = chunk(b"data: " + json.dumps(event({"role": "assistant", "content": ""})).encode() + b"\n\n")
    reply = SSE_HEAD + head + sse_event(event({"content": " he"}), [32, 104, 101])  # then the connection drops
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "rid": "c-1", "max_tokens": 8,
            "temperature": 0, "stream_options": {"include_usage": True}}
    r, decode, tokenizer = migrated(reply, "/v1/chat/completions", body)
    events = [json.loads(x) for x in sse_data(r.text)[:-1]]
    assert all("error" not in e for e in events), r.text
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert sum("role" in d for d in deltas) == 1
    assert "".join(d.get("content") or "" for d in deltas) == " hello w"  # the stub's reply, 8 tokens, once each
    assert decode.submitted[0].generated_before == [32, 104, 101]
    usage = events[-1]["usage"]
    assert usage["completion_tokens"] == 8 and usage["prompt_tokens"] == len(decode.submitted[0].input_ids) - 3


CHAT_HEAD = b"data: " + json.dumps({"id": "chatcmpl-c-2", "object": "chat.completion.chunk", "model": "stub",
                                      "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                   "finish_reason": None}]}).encode() + b"\n\n"


@pytest.mark.parametrize("sent", ["nothing", "half_the_head", "the_head"])
def test_a_chat_stream_cut_before_its_first_token_reaches_its_client_with_one_role_chunk(sent):
    """A decode killed after its 200 and before the role chunk reached the client (or its first token, after it):
    the stream goes on elsewhere, and the client gets the role chunk once (seen in a fleet run: a SIGKILLed decode,
    a continuation without a role chunk)."""
    cut = {"nothing": b"", "half_the_head": CHAT_HEAD[:40], "the_head": CHAT_HEAD}[sent]
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "rid": "c-2", "max_tokens": 4,
            "temperature": 0}
    r, decode, _ = migrated(SSE_HEAD + (chunk(cut) if cut else b""), "/v1/chat/completions", body)
    events = [json.loads(x) for x in sse_data(r.text)[:-1]]
    assert all("error" not in e for e in events), r.text
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert sum("role" in d for d in deltas) == 1, r.text
    assert deltas[0]["role"] == "assistant", r.text
    assert "".join(d.get("content") or "" for d in deltas) == " hel"
    assert decode.submitted[0].generated_before == []


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
        app = create_router_app([(p.url, 9000)], [drained.url, d_good.url], health_interval_s=0.1, pd_policy=CLASSIC_PD)
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


def test_a_stream_its_draining_node_aborts_continues_elsewhere():
    event = {"id": "cmpl-d-1", "object": "text_completion", "choices": [{"index": 0, "text": " h",
                                                                         "finish_reason": None}]}
    aborted = {"error": {"message": "aborted: this node is draining", "type": "ServiceUnavailableError",
                         "code": 503}}
    reply = (SSE_HEAD + sse_event(event, [32, 104]) + chunk(b"data: " + json.dumps(aborted).encode() + b"\n\n")
             + chunk(b"data: [DONE]\n\n"))
    body = {"prompt": "hi", "stream": True, "rid": "d-1", "max_tokens": 5, "temperature": 0}
    r, decode, _ = migrated(reply, "/v1/completions", body)
    events = [json.loads(x) for x in sse_data(r.text)[:-1]]
    assert all("error" not in e for e in events), r.text
    assert "".join(c["text"] for e in events for c in e["choices"]) == " hell"
    assert decode.submitted[0].generated_before == [32, 104]


def router_before_a_silent_decode(reply: bytes):
    """A router in front of a stub prefill, a decode that sends ``reply`` and then nothing while holding the
    connection (a stopped node: from then on its /health gets the same silence; it answered 200 before), and a good
    stub decode; 0.1 s health checks. Returned once the router has taken all three in. A check times out after 1 s:
    with 0.3 s, a loaded machine's slow answer ejected the silent decode just before the request, which then went
    to the good one and never migrated (seen once in a full run)."""
    prefill, decode = StubEngine(role="prefill"), StubEngine(role="decode")
    stack = contextlib.ExitStack()
    silent = stack.enter_context(raw_worker(reply, hold_s=300, stopped_when_held=True)).url  # past the client's 60 s
    p = stack.enter_context(AppServer(create_app(prefill, prefill.tokenizer, bootstrap_port=9000)))
    d = stack.enter_context(AppServer(create_app(decode, decode.tokenizer)))
    app = create_router_app([(p.url, 9000)], [silent, d.url], health_interval_s=0.1, health_timeout_s=1.0,
                            pd_policy=CLASSIC_PD)
    router = stack.enter_context(AppServer(app))
    stack.callback(prefill.close)
    stack.callback(decode.close)
    assert until(lambda: httpx.get(router.url + "/health", timeout=5).json()["admitted"] == {"prefill": 1, "decode": 2})
    return stack, router.url, decode


def test_a_stream_whose_decode_stops_answering_moves_on_once_its_health_checks_fail():
    event = {"id": "cmpl-s-1", "object": "text_completion", "choices": [{"index": 0, "text": " h",
                                                                         "finish_reason": None}]}
    stack, url, decode = router_before_a_silent_decode(SSE_HEAD + sse_event(event, [32, 104]))
    with stack:
        body = {"prompt": "hi", "stream": True, "rid": "s-1", "max_tokens": 5, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)  # the router's deadline is 30 min
        events = [json.loads(x) for x in sse_data(r.text)[:-1]]
        assert all("error" not in e for e in events), r.text
        assert "".join(c["text"] for e in events for c in e["choices"]) == " hell"
        assert decode.submitted[0].generated_before == [32, 104]
        assert counter(url, "fsm_pd_router_migrations_total") == {'{reason="decode_stream_broken"}': 1.0}


def test_a_whole_request_on_a_decode_that_never_answers_is_retried_once_its_health_checks_fail():
    stack, url, decode = router_before_a_silent_decode(b"")
    with stack:
        r = httpx.post(url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3}}, timeout=60)
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 3, r.text
        assert len(decode.submitted) == 1
        assert counter(url, "fsm_pd_router_migrations_total") == {'{reason="decode_lost"}': 1.0}


class LateFirstGenerate:
    """ASGI: the first /generate this node gets is read whole and then reaches the app ``delay_s`` later, as on a
    node whose event loop comes to the handler late; /abort_request answers ``abort_status`` when one is set."""

    def __init__(self, app, delay_s: float, abort_status: int | None = None):
        self.app, self.delay_s, self.abort_status, self.held = app, delay_s, abort_status, False

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/abort_request" and self.abort_status is not None:
            await JSONResponse({"error": {"message": "boom"}}, status_code=self.abort_status)(scope, receive, send)
            return
        if scope["type"] == "http" and scope["path"] == "/generate" and not self.held:
            self.held = True
            message, received = await receive(), False
            await asyncio.sleep(self.delay_s)

            async def replay():
                nonlocal received
                if not received:
                    received = True
                    return message
                return await receive()

            await self.app(scope, replay, send)
            return
        await self.app(scope, receive, send)


def draining_then_late_decode(decode: StubEngine, *, abort_status: int | None = None):
    """A router over a prefill that refuses at once as a draining node does (503), a good prefill, and one decode
    whose first request reaches its engine 0.5 s late: after the router's abort of that attempt."""
    draining = StubEngine(role="prefill", submit_error=EngineError("this node is draining", 503))
    good = StubEngine(role="prefill")
    stack = contextlib.ExitStack()
    p_urls = [stack.enter_context(AppServer(create_app(e, e.tokenizer, bootstrap_port=port))).url
              for e, port in ((draining, 9001), (good, 9002))]
    d_app = LateFirstGenerate(create_app(decode, decode.tokenizer, bootstrap_port=8998), 0.5, abort_status)
    d_url = stack.enter_context(AppServer(d_app)).url
    router = stack.enter_context(AppServer(create_router_app([(p_urls[0], 9001), (p_urls[1], 9002)], [d_url],
                                                             pd_policy=CLASSIC_PD)))
    stack.callback(lambda: [e.close() for e in (draining, good, decode)])
    return stack, router.url, good


def test_the_abort_of_a_failed_attempt_that_comes_first_refuses_its_late_leg_and_the_retry_runs():
    # The race a second abort 50 ms later used to cover: the draining prefill refuses at once, the router aborts the
    # attempt on the decode it reuses, and the attempt's own decode request comes after that abort.
    decode = StubEngine(role="decode")
    stack, url, good = draining_then_late_decode(decode)
    with stack:
        r = httpx.post(url + "/generate", json={"text": "hi", "rid": "client-1",
                                                "sampling_params": {"max_new_tokens": 3}}, timeout=20)
        assert r.status_code == 200 and r.json()["text"] == " he", r.text
        # the retry's prefill leg runs beside its decode leg, and the stub decode answers without waiting for it: the
        # answer can come back before the good prefill's app has submitted (seen once in a whole run on 2 busy cores)
        assert until(lambda: good.submitted, timeout_s=5), "the retry never reached the good prefill"
        retry_room = good.submitted[0].bootstrap.room
        # the late leg was refused when it came (it was not left waiting for a room its prefill never opened), and
        # only the retry ran on the decode
        assert until(lambda: decode.refused, timeout_s=5), f"the late leg ran: {decode.submitted}"
        (late, err), = decode.refused
        assert (late.rid, err.status) == ("client-1", 499) and late.bootstrap.room != retry_room
        assert [q.bootstrap.room for q in decode.submitted] == [retry_room]
        assert decode.aborts == [("client-1", late.bootstrap.room)]  # the router's abort named the attempt


@pytest.mark.parametrize("abort_status", [500, 404])
def test_a_failed_wind_down_abort_is_logged_and_the_retry_still_runs(caplog, abort_status):
    caplog.set_level(logging.WARNING, logger="fsm_pd.router.attempts")
    decode = StubEngine(role="decode")
    stack, url, good = draining_then_late_decode(decode, abort_status=abort_status)
    with stack:
        r = httpx.post(url + "/generate", json={"text": "hi", "rid": "client-2",
                                                "sampling_params": {"max_new_tokens": 3}}, timeout=20)
        assert r.status_code == 200 and r.json()["text"] == " he", r.text
        # the late leg, not aborted, was closed: its node aborts it when it notices, and the retry is not touched
        assert until(lambda: decode.live == [])
    warnings = [rec.getMessage() for rec in caplog.records if rec.name == "fsm_pd.router.attempts"]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("could not abort request client-2 (room ") and \
        "on the decode worker http://127.0.0.1:" in warnings[0] and f"it answered {abort_status}" in warnings[0]


LONG = {"input_ids": [20 + i % 200 for i in range(300)], "sampling_params": {"max_new_tokens": 2}}  # > 256: PD


def test_a_killed_prefill_is_out_at_its_first_refused_connection_and_the_request_is_served_without_it():
    """The only prefill node dies: the request's first attempt finds its address refused, the router takes it out at
    once (it kept trying it: 3 attempts in 30 ms, then a 503 "gave up after 3 attempts", and every long prompt after
    got one until the health checks ejected it) and the retry goes to the decode node's own prefill (``auto``).
    A refused attempt uses none of the request's tries: it ran nowhere and took a worker out."""
    prefill, decode = StubEngine(role="prefill"), StubEngine(role="decode")
    with contextlib.ExitStack() as stack:
        d = stack.enter_context(AppServer(create_app(decode, decode.tokenizer)))
        p = AppServer(create_app(prefill, prefill.tokenizer, bootstrap_port=9000)).start()
        app = create_router_app([(p.url, 9000)], [d.url], retry=RetrySettings(max_retries=0))
        router = stack.enter_context(AppServer(app))
        assert until(lambda: httpx.get(router.url + "/readiness", timeout=5).json()["ready"]["prefill"] == 1)
        p.stop()  # killed: nothing listens at its address any more
        for rid in ("first", "second"):
            r = httpx.post(router.url + "/generate", json={**LONG, "rid": rid}, timeout=20)
            assert r.status_code == 200, r.text
            assert decode.submitted[-1].rid == rid and decode.submitted[-1].route["path"] == "local"
        info = httpx.get(router.url + "/server_info", timeout=5).json()["prefill"][0]
        assert not info["admitted"] and info["reason"].startswith("refused"), info
        assert counter(router.url, "fsm_pd_router_retries_total") == {'{reason="prefill_refused"}': 1.0}
        assert counter(router.url, "fsm_pd_router_worker_ejections_total") == \
            {'{reason="refused",role="prefill"}': 1.0}
    prefill.close()
    decode.close()


def router_after_a_dying_prefill(stack: contextlib.ExitStack, decode: StubEngine):
    """A prefill worker whose connection breaks off before its answer (a process that died), ``decode`` behind a
    router of one attempt: (the dying worker, the router's URL)."""
    dying = stack.enter_context(raw_worker(b"", then_close=True))
    d = stack.enter_context(AppServer(create_app(decode, decode.tokenizer)))
    app = create_router_app([(dying.url, 9000)], [d.url], retry=RetrySettings(policy="fail"), pd_policy=CLASSIC_PD)
    return dying, stack.enter_context(AppServer(app)).url


def test_a_prefill_that_dies_mid_request_leaves_the_request_to_its_decode_which_recomputes_it():
    """The prefill node's connection breaks off before its answer (the process died): the decode node holds the
    request and recomputes the prompt itself, so the router waits for its answer instead of closing its leg (which
    cancelled the recompute) and computing the prompt again elsewhere. One attempt, the decode's answer."""
    decode = StubEngine(role="decode", token_delay_s=0.2)  # its first token comes after the prefill broke off
    with contextlib.ExitStack() as stack:
        dying, router = router_after_a_dying_prefill(stack, decode)
        r = httpx.post(router + "/generate", json={**LONG, "rid": "once"}, timeout=20)
        assert r.status_code == 200, r.text
        assert len(dying.requests) == 1 and [q.rid for q in decode.submitted] == ["once"]
        assert decode.aborted == []
    decode.close()


def test_when_the_decode_fails_too_after_its_prefill_died_the_failure_is_the_prefills():
    decode = StubEngine(role="decode", token_delay_s=0.2, fail_after=0)  # its room failed on the dead peer
    with contextlib.ExitStack() as stack:
        _, router = router_after_a_dying_prefill(stack, decode)
        r = httpx.post(router + "/generate", json=LONG, timeout=20)
        assert r.status_code == 502 and r.json()["error"]["code"] == "prefill_unreachable", r.text
    decode.close()


def test_a_prefill_restarted_at_its_address_serves_the_next_request_without_waiting_for_a_check_round(monkeypatch):
    """Its refused connection took it out; when no other prefill is left, a request checks the refused one again
    before its 503, so a node restarted at the same address (a supervisor's restart) serves it at once."""
    monkeypatch.setattr("fsm_pd.router.fleet.OUT_CHECK_INTERVAL_S", 60.0)  # no round of checks takes it back
    prefill, decode = StubEngine(role="prefill"), StubEngine(role="decode")
    with contextlib.ExitStack() as stack:
        d = stack.enter_context(AppServer(create_app(decode, decode.tokenizer)))
        p = AppServer(create_app(prefill, prefill.tokenizer, bootstrap_port=9000)).start()
        app = create_router_app([(p.url, 9000)], [d.url], pd_policy=CLASSIC_PD, health_interval_s=60.0)
        router = stack.enter_context(AppServer(app))
        assert until(lambda: httpx.get(router.url + "/readiness", timeout=5).status_code == 200)
        p.stop()
        gone = httpx.post(router.url + "/generate", json={"text": "a"}, timeout=20)
        assert gone.status_code == 503 and gone.json()["error"]["code"] == "no_healthy_prefill", gone.text
        back = stack.enter_context(AppServer(create_app(prefill, prefill.tokenizer, bootstrap_port=9000),
                                             port=p.port))
        r = httpx.post(router.url + "/generate", json={"text": "a"}, timeout=20)
        assert r.status_code == 200, r.text
        assert back.url == p.url
    prefill.close()
    decode.close()
