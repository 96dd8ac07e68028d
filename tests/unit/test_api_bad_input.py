"""No input reaches an engine unchecked: out-of-range rooms and sampling values, NaN, Infinity and lone surrogates get
a 400 that says what is wrong, from every route of a node and from the built-in router (stub engines, real sockets).
"""

from __future__ import annotations

import contextlib

import httpx
import pytest
from real_parts import TCP
from stub_engine import StubEngine, stub_server

from fsm_pd.api import AppServer, create_app
from fsm_pd.api.strict_json import lone_surrogate_at, strict_loads
from fsm_pd.router import create_router_app
from fsm_pd.router.policy import CLASSIC_PD

PD = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998}


def raw_post(client: httpx.Client, path: str, body: str | bytes) -> httpx.Response:
    # raw text: httpx's json= would refuse to write NaN or a lone surrogate in the first place
    return client.post(path, content=body, headers={"content-type": "application/json"})


@pytest.fixture
def node():
    with stub_server("decode", bootstrap_port=8998) as (url, engine), httpx.Client(base_url=url, timeout=10) as c:
        yield c, engine


@pytest.mark.parametrize("room, fragment", [
    (2**63, "less than or equal to 9223372036854775807"),
    (2**64 - 1, "less than or equal to 9223372036854775807"),
    (2**64, "less than or equal to 9223372036854775807"),
    (-1, "greater than or equal to 0"),
])
@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
@TCP
def test_out_of_range_room_is_400_before_the_engine(node, path, room, fragment):
    client, engine = node
    body = {"text": "a", "prompt": "a", "messages": [{"role": "user", "content": "a"}], "max_tokens": 1,
            **PD, "bootstrap_room": room}
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert "bootstrap_room" in r.json()["error"]["message"] and fragment in r.json()["error"]["message"]
    assert engine.submitted == []
    ok = client.post(path, json={**body, "bootstrap_room": 2**63 - 1})  # the largest room is served
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("params, fragment", [
    ({"top_k": 10**12}, "top_k"),
    ({"top_k": 2**30 + 1}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 2}, "min_p"),
    ({"repetition_penalty": 2.5}, "repetition_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"logit_bias": {"999": 1}}, "logit_bias"),
    ({"n": 17}, "n"),
    ({"seed": 2**63}, "seed"),
    ({"sampling_seed": -1}, "sampling_seed"),
    ({"stop": ["x"] * 65}, "stop strings"),
    ({"stop_token_ids": [2**31]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"max_new_tokens": 10**30}, "exceed"),
])
@TCP
def test_out_of_range_sampling_is_400_before_the_engine(node, params, fragment):
    client, engine = node
    r = client.post("/generate", json={"text": "a", **PD, "bootstrap_room": 1, "sampling_params": params})
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]
    assert engine.submitted == []


@pytest.mark.parametrize("path, extra", [
    ("/v1/completions", {"prompt": "a", "top_k": 10**12}),
    ("/v1/completions", {"prompt": "a", "seed": 2**64}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "min_p": 1.3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "stop": ["s"] * 100}),
])
@TCP
def test_openai_out_of_range_sampling_is_400(node, path, extra):
    client, engine = node
    r = client.post(path, json={**PD, "bootstrap_room": 1, **extra})
    assert r.status_code == 400, r.text
    assert engine.submitted == []


SGLANG = '{"text": %s, "bootstrap_host": "127.0.0.1", "bootstrap_room": 5, "sampling_params": {%s}}'
COMPLETION = '{"prompt": %s, "bootstrap_host": "127.0.0.1", "bootstrap_room": 5, %s}'
CHAT = '{"messages": [{"role": "user", "content": %s}], "bootstrap_host": "127.0.0.1", "bootstrap_room": 5, %s}'
NOT_JSON_NUMBERS = ['"temperature": NaN', '"top_p": Infinity', '"temperature": -Infinity', '"top_p": 1e999']
# escaped, escaped in a reversed pair, and raw (UTF-8-encoded surrogate bytes, which json decodes with surrogatepass)
LONE_SURROGATES = ['"\\ud800"', '"ok \\udfff ok"', '"\\uDC00\\uD800"', '"\ud800"']


def _bodies() -> list[tuple[str, str, str]]:
    cases = []
    for number in NOT_JSON_NUMBERS:
        cases += [("/generate", SGLANG % ('"a"', number), "JSON number"),
                  ("/v1/completions", COMPLETION % ('"a"', number), "JSON number"),
                  ("/v1/chat/completions", CHAT % ('"a"', number), "JSON number")]
    cases[-1] = (cases[-1][0], cases[-1][1], "out of range")  # 1e999 is a number that overflows
    cases[-2] = (cases[-2][0], cases[-2][1], "out of range")
    cases[-3] = (cases[-3][0], cases[-3][1], "out of range")
    for text in LONE_SURROGATES:
        cases += [("/generate", SGLANG % (text, '"max_new_tokens": 1'), "lone surrogate"),
                  ("/generate", SGLANG % ('"a"', f'"stop": [{text}]'), "lone surrogate"),
                  ("/v1/completions", COMPLETION % (text, '"max_tokens": 1'), "lone surrogate"),
                  ("/v1/chat/completions", CHAT % (text, '"max_tokens": 1'), "lone surrogate"),
                  ("/v1/chat/completions", CHAT % ('"a"', f'"stop": {text}'), "lone surrogate")]
    return cases


@pytest.mark.parametrize("path, body, fragment", _bodies())
@TCP
def test_nan_infinity_and_lone_surrogates_are_400_on_every_node_route(node, path, body, fragment):
    client, engine = node
    r = raw_post(client, path, body.encode("utf-8", "surrogatepass"))
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]
    assert engine.submitted == []


@TCP
def test_surrogate_pairs_and_plain_unicode_are_served(node):
    client, engine = node
    r = raw_post(client, "/generate", SGLANG % ('"smile \\ud83d\\ude00 caf\\u00e9 ✓"', '"max_new_tokens": 1'))
    assert r.status_code == 200, r.text
    assert engine.submitted[0].input_ids  # the emoji and the accents reached the tokenizer as characters


def test_strict_loads_on_its_own():
    assert strict_loads(b'{"a": [1, 2.5, "\\ud83d\\ude00"]}') == {"a": [1, 2.5, "\U0001F600"]}
    assert lone_surrogate_at({"a": [{"b": "x\ud800"}]}) == "body.a[0].b"
    assert lone_surrogate_at({"a": ["fine", 1, None]}) is None
    for text in ('NaN', '[Infinity]', '{"x": -Infinity}', '1e400', '"\\ud800"'):
        with pytest.raises(ValueError):
            strict_loads(text)


@contextlib.contextmanager
def router_over_stubs():
    prefill, decode = StubEngine(role="prefill"), StubEngine(role="decode")
    with contextlib.ExitStack() as stack:
        p_url = stack.enter_context(AppServer(create_app(prefill, prefill.tokenizer, bootstrap_port=8998))).url
        d_url = stack.enter_context(AppServer(create_app(decode, decode.tokenizer, bootstrap_port=8998))).url
        url = stack.enter_context(AppServer(create_router_app([(p_url, 8998)], [d_url], pd_policy=CLASSIC_PD))).url
        client = stack.enter_context(httpx.Client(base_url=url, timeout=10))
        yield client, prefill, decode
        prefill.close()
        decode.close()


@TCP
def test_router_refuses_nan_infinity_and_lone_surrogates_and_keeps_routing():
    with router_over_stubs() as (client, prefill, decode):
        for path, body, fragment in _bodies():
            r = raw_post(client, path, body.encode("utf-8", "surrogatepass"))
            assert r.status_code == 400, (path, body, r.text)
            assert fragment in r.json()["error"]["message"]
        assert prefill.submitted == [] and decode.submitted == []  # nothing reached a worker
        ok = client.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 2}})
        assert ok.status_code == 200, ok.text
