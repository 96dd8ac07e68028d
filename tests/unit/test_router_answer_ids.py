"""What a client of the built-in router can name its request by and read its path from, whatever the API: a failed
request's error body carries its rid (``error.rid``, what ``fsm-pd replay --request`` takes), and an answer carries
the route the decode node served it by (``X-FSM-PD-Route``, ``X-FSM-PD-Route-Reason``), on OpenAI answers too, which
have no ``meta_info``. The router runs in process; its workers are an ``httpx.MockTransport``."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from fsm_pd.api.errors import error_body, with_rid
from fsm_pd.api.streaming import RECOMPUTED_HEADER, ROUTE_HEADER, ROUTE_REASON_HEADER
from fsm_pd.router.core import PDRouter, PrefillWorker
from fsm_pd.router.policy import CLASSIC_PD


class StayingClient:
    """The ASGI request as ``dispatch`` reads it: a client that waits for its whole answer."""

    headers: dict = {}

    async def receive(self) -> dict:
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ROUTE = {ROUTE_HEADER: "pd", ROUTE_REASON_HEADER: "policy always"}
RECOMPUTED = {**ROUTE, RECOMPUTED_HEADER: "1"}  # a decode node that prefilled the prompt after a failed transfer


def ask(path: str, body: dict, decode: str, stream: bool = False, headers: dict = ROUTE):
    """One request through a router over one prefill and one decode worker; ``decode``: what the decode leg does:
    ``ok`` (answers with ``headers``, by default the route headers a node sends) or ``fail`` (500)."""
    async def scenario():
        async def workers(request: httpx.Request) -> httpx.Response:
            if request.url.path == "/health":
                return httpx.Response(200, json={})
            if request.url.path == "/abort_request":
                return httpx.Response(200, json={"aborted": []})
            if request.url.host == "p0":
                return httpx.Response(200, json={"text": "", "meta_info": {}})
            if decode == "fail":
                return httpx.Response(500, json=error_body(500, "the engine failed"))
            if stream:
                return httpx.Response(200, headers={"content-type": "text/event-stream", **headers},
                                      content=b'data: {"id": "chatcmpl-x"}\n\ndata: [DONE]\n\n')
            return httpx.Response(200, headers=headers, json={"id": "chatcmpl-x", "choices": []})

        router = PDRouter([PrefillWorker("http://p0", 8998)], ["http://d0"], health_interval_s=60,
                          pd_policy=CLASSIC_PD)
        router._client = httpx.AsyncClient(transport=httpx.MockTransport(workers))
        try:
            response = await router.dispatch(path, {**body, "stream": stream}, StayingClient())
            chunks = [c async for c in response.body_iterator] if hasattr(response, "body_iterator") else []
            return response, chunks
        finally:
            router._health_task.cancel()
            await router.aclose()

    return asyncio.run(asyncio.wait_for(scenario(), 30))


@pytest.mark.parametrize("stream", [False, True])
def test_an_openai_answer_carries_the_route_the_decode_node_served_it_by(stream):
    response, _ = ask("/v1/chat/completions", CHAT, "ok", stream)
    assert response.status_code == 200
    assert response.headers[ROUTE_HEADER] == "pd" and response.headers[ROUTE_REASON_HEADER] == "policy always"


@pytest.mark.parametrize("stream", [False, True])
def test_a_recomputed_answer_says_so_through_the_router(stream):
    response, _ = ask("/v1/chat/completions", CHAT, "ok", stream, headers=RECOMPUTED)
    assert response.status_code == 200
    assert {name: response.headers.get(name) for name in RECOMPUTED} == RECOMPUTED


def test_a_failed_request_s_error_names_its_rid():
    response, _ = ask("/v1/chat/completions", CHAT, "fail")
    body = json.loads(response.body)
    # the retries (one decode worker) end in the router's own 503; its body names the rid every attempt carried
    assert response.status_code == 503 and body["error"]["code"] == "retries_exhausted"
    rid = body["error"]["rid"]
    assert isinstance(rid, str) and len(rid) == 32
    response, _ = ask("/generate", {"text": "hi", "rid": "mine-1"}, "fail")
    assert json.loads(response.body)["error"]["rid"] == "mine-1"


def test_with_rid_adds_the_rid_to_an_error_body_only():
    from fastapi.responses import JSONResponse

    failed = with_rid(JSONResponse(error_body(503, "no"), status_code=503), "r1")
    assert json.loads(failed.body)["error"] == {"message": "no", "type": "ServiceUnavailableError", "code": 503,
                                                "rid": "r1"}
    ok = JSONResponse({"error": "not an error answer"}, status_code=200)
    assert with_rid(ok, "r1") is ok
    named = JSONResponse(error_body(500, "x", rid="r0"), status_code=500)
    assert json.loads(with_rid(named, "r1").body)["error"]["rid"] == "r0"  # a worker's own says which it was
