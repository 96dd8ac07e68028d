"""SGLang /generate over real sockets, against the stub engine: shapes, streaming, logprobs, stops, PD fields."""

from __future__ import annotations

import json

import httpx
import pytest
from real_parts import TCP
from stub_engine import DECODE_LOGPROB, PREFILL_LOGPROB, stub_server

pytestmark = TCP  # every test here serves or connects on 127.0.0.1 (tests/real_parts.py)


def sse_events(text: str) -> list:
    lines = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.fixture
def colocated():
    with stub_server("colocated") as (url, engine), httpx.Client(base_url=url, timeout=10) as client:
        yield client, engine


def test_generate_text_answers_sglang_shape(colocated):
    client, engine = colocated
    r = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 5, "temperature": 0},
                                       "rid": "r-1"})
    assert r.status_code == 200
    body = r.json()
    assert body["text"] == " hell"
    assert body["output_ids"] == list(b" hell")
    meta = body["meta_info"]
    assert meta["id"] == "r-1"
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (2, 5)
    assert "input_token_logprobs" not in meta
    sent = engine.submitted[0]
    assert sent.input_ids == list(b"hi") and sent.sampling.temperature == 0 and sent.bootstrap is None


def test_generate_input_ids_and_sampling_params_reach_the_engine(colocated):
    client, engine = colocated
    sp = {"max_new_tokens": 4, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "stop": ["zz"],
          "stop_token_ids": [3], "ignore_eos": True, "seed": 42}
    r = client.post("/generate", json={"input_ids": [104, 105], "sampling_params": sp})
    assert r.status_code == 200
    s = engine.submitted[0]
    assert s.input_ids == [104, 105]
    assert (s.sampling.temperature, s.sampling.top_p, s.sampling.top_k) == (0.5, 0.9, 7)
    assert s.sampling.stop == ("zz",) and s.sampling.stop_token_ids == (3,) and s.sampling.ignore_eos
    assert s.seed == 42 and s.sampling.max_new_tokens == 4


def test_generate_sglang_sampling_seed_and_top_k_minus_one(colocated):
    client, engine = colocated
    r = client.post("/generate", json={"text": "a", "sampling_params": {"sampling_seed": 7, "top_k": -1,
                                                                         "max_new_tokens": 1}})
    assert r.status_code == 200
    assert engine.submitted[0].seed == 7 and engine.submitted[0].sampling.top_k == 0


def test_generate_stop_string_is_cut_from_text(colocated):
    client, _ = colocated
    r = client.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 20, "stop": "wor"}})
    body = r.json()
    assert body["text"] == " hello "
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": "wor"}


def test_generate_stop_token_id_ends_output_and_is_not_in_text(colocated):
    client, _ = colocated
    r = client.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 20,
                                                                         "stop_token_ids": [ord("l")]}})
    body = r.json()
    assert body["text"] == " he"
    assert body["output_ids"][-1] == ord("l")
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": ord("l")}


def test_generate_return_logprob_shapes(colocated):
    client, _ = colocated
    r = client.post("/generate", json={"text": "hi", "return_logprob": True, "sampling_params": {"max_new_tokens": 2}})
    meta = r.json()["meta_info"]
    assert meta["output_token_logprobs"] == [[DECODE_LOGPROB, ord(" "), None], [DECODE_LOGPROB, ord("h"), None]]
    assert meta["input_token_logprobs"] == []  # a decoding engine has no prompt logprobs; prefill's come merged


def test_generate_stream_sends_cumulative_chunks_then_done(colocated):
    client, _ = colocated
    r = client.post("/generate", json={"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 3}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert [e["text"] for e in events] == [" ", " h", " he"]
    assert [e["output_ids"] for e in events][-1] == list(b" he")
    assert [e["meta_info"]["finish_reason"] for e in events] == [None, None, {"type": "length", "length": 3}]


def test_generate_stream_holds_back_a_possible_stop_string(colocated):
    client, _ = colocated
    r = client.post("/generate", json={"text": "x", "stream": True,
                                       "sampling_params": {"max_new_tokens": 20, "stop": "lo w"}})
    texts = [e["text"] for e in sse_events(r.text)]
    assert texts[-1] == " hel"
    assert all(" hel".startswith(t) for t in texts), texts  # never showed "lo" before the stop matched


def test_prefill_node_refuses_request_without_bootstrap_fields():
    with stub_server("prefill", bootstrap_port=8998) as (url, engine):
        r = httpx.post(url + "/generate", json={"text": "hi"}, timeout=10)
        assert r.status_code == 400
        assert "bootstrap_host" in r.json()["error"]["message"]
        assert engine.submitted == []


def test_prefill_node_answers_one_token_with_prompt_logprobs():
    with stub_server("prefill", bootstrap_port=8998) as (url, engine):
        body = {"text": "hey", "return_logprob": True, "bootstrap_host": "127.0.0.1", "bootstrap_port": 8998,
                "bootstrap_room": 12345}
        r = httpx.post(url + "/generate", json=body, timeout=10)
        assert r.status_code == 200
        meta = r.json()["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 0}
        assert meta["input_token_logprobs"] == [[None, ord("h"), None], [PREFILL_LOGPROB, ord("e"), None],
                                                [PREFILL_LOGPROB, ord("y"), None]]
        boot = engine.submitted[0].bootstrap
        assert (boot.host, boot.port, boot.room) == ("127.0.0.1", 8998, 12345)


def test_decode_node_takes_its_default_port_for_null_and_seed_from_room():
    with stub_server("decode", bootstrap_port=7777) as (url, engine):
        body = {"text": "hey", "bootstrap_host": "10.0.0.1", "bootstrap_port": None, "bootstrap_room": 2**62 + 5,
                "sampling_params": {"max_new_tokens": 1}}
        assert httpx.post(url + "/generate", json=body, timeout=10).status_code == 200
        sent = engine.submitted[0]
        assert sent.bootstrap.port == 7777
        assert sent.seed == (2**62 + 5) & 0x7FFFFFFF  # P and D derive the same seed from the shared room


def test_colocated_node_ignores_bootstrap_fields(colocated):
    client, engine = colocated
    r = client.post("/generate", json={"text": "a", "bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 1,
                                       "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200 and engine.submitted[0].bootstrap is None


@pytest.mark.parametrize("body, fragment", [
    ({"sampling_params": {"max_new_tokens": 1}}, "exactly one of text or input_ids"),
    ({"text": "a", "input_ids": [1]}, "exactly one of text or input_ids"),
    ({"text": ["a"] * 65}, "batch"),
    ({"input_ids": [1, 999999]}, "outside the vocabulary"),
    ({"text": ""}, "empty"),
    ({"text": "a", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 10**9}}, "exceed"),
    ({"text": "a" * 600}, "context"),
    ({"text": "a", "sampling_params": {"temperature": -1}}, "temperature"),
    ({"text": "a", "sampling_params": {"top_p": 0}}, "top_p"),
    ({"text": "a", "sampling_params": {"stop": [""]}}, "stop"),
    ({"text": "a", "sampling_params": {"regex": "(a"}}, "regex"),
    ({"text": "a", "sampling_params": {"json_schema": "{oops"}}, "json_schema"),
    ({"text": "a", "sampling_params": {"ebnf": "root ::= missing"}}, "ebnf"),
    ({"text": "a", "sampling_params": {"regex": "a", "ebnf": "root ::= 'a'"}}, "at most one"),
    ({"text": "a", "sampling_params": {"structural_tag": "{}"}}, "structural_tag"),
    ({"text": "a", "top_logprobs_num": 21, "return_logprob": True}, "top_logprobs_num"),
    ({"text": "a", "logprob_start_len": -2, "return_logprob": True}, "logprob_start_len"),
    ({"text": "a", "model": "other"}, "does not exist"),
])
def test_generate_bad_input_is_400_with_a_message(colocated, body, fragment):
    client, engine = colocated
    r = client.post("/generate", json=body)
    assert 400 <= r.status_code < 500, r.text
    assert fragment in r.json()["error"]["message"]
    assert engine.submitted == []
