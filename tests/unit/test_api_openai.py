"""OpenAI-compatible routes over real sockets against the stub engine, with raw httpx and the openai client."""

from __future__ import annotations

import json

import httpx
import pytest
from real_parts import TCP
from stub_engine import DECODE_LOGPROB, stub_server

pytestmark = TCP  # every test here serves or connects on 127.0.0.1 (tests/real_parts.py)


def sse_events(text: str) -> list:
    lines = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.fixture
def server():
    with stub_server("colocated") as (url, engine), httpx.Client(base_url=url, timeout=10) as client:
        yield client, engine


def test_completion_whole(server):
    client, engine = server
    r = client.post("/v1/completions", json={"model": "stub-model", "prompt": "hi", "max_tokens": 3, "seed": 5})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "stub-model"
    assert body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == " he"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert engine.submitted[0].seed == 5


def test_completion_default_max_tokens_is_16_and_token_prompt_is_accepted(server):
    client, engine = server
    r = client.post("/v1/completions", json={"model": "stub-model", "prompt": [104, 105]})
    assert r.status_code == 200
    assert engine.submitted[0].input_ids == [104, 105] and engine.submitted[0].sampling.max_new_tokens == 16


def test_completion_logprobs_legacy_shape(server):
    client, _ = server
    r = client.post("/v1/completions", json={"model": "stub-model", "prompt": "hi", "max_tokens": 2, "logprobs": 0})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp == {"tokens": [" ", "h"], "token_logprobs": [DECODE_LOGPROB, DECODE_LOGPROB], "top_logprobs": None,
                  "text_offset": [0, 1]}


def test_completion_stream_deltas_usage_and_done(server):
    client, _ = server
    r = client.post("/v1/completions", json={"model": "stub-model", "prompt": "hi", "max_tokens": 4, "stream": True,
                                             "stream_options": {"include_usage": True}})
    events = sse_events(r.text)
    texts = "".join(c["text"] for e in events for c in e["choices"])
    assert texts == " hel"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4


def test_chat_whole_uses_the_chat_template(server):
    client, engine = server
    r = client.post("/v1/chat/completions", json={"model": "stub-model", "max_tokens": 2, "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": " h"}
    prompt = bytes(i for i in engine.submitted[0].input_ids if i < 256).decode()
    assert "system\nbe brief" in prompt and prompt.endswith("assistant\n")
    assert engine.submitted[0].input_ids.count(257) == 3  # <|im_start|> for system, user and the reply


def test_chat_max_completion_tokens_wins_and_default_is_the_rest_of_the_context(server):
    client, engine = server
    messages = [{"role": "user", "content": "hi"}]
    client.post("/v1/chat/completions", json={"model": "stub-model", "messages": messages, "max_tokens": 9,
                                              "max_completion_tokens": 2})
    assert engine.submitted[0].sampling.max_new_tokens == 2
    client.post("/v1/chat/completions", json={"model": "stub-model", "messages": messages})
    second = engine.submitted[1]
    assert second.sampling.max_new_tokens == 512 - len(second.input_ids)


def test_chat_logprobs_and_stream(server):
    client, _ = server
    r = client.post("/v1/chat/completions", json={"model": "stub-model", "messages": [{"role": "user", "content": "x"}],
                                                  "max_tokens": 3, "stream": True, "logprobs": True})
    events = sse_events(r.text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:])
    assert content == " he"
    tokens = [t["token"] for e in events[1:] for t in (e["choices"][0]["logprobs"] or {}).get("content", [])]
    assert tokens == [" ", "h", "e"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_models_lists_the_served_name(server):
    client, _ = server
    body = client.get("/v1/models").json()
    assert [m["id"] for m in body["data"]] == ["stub-model"]


@pytest.mark.parametrize("path, body, status, fragment", [
    ("/v1/completions", {"model": "gpt-9", "prompt": "a"}, 404, "does not exist"),
    ("/v1/completions", {"model": "stub-model", "prompt": "a", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"model": "stub-model", "prompt": "a", "max_tokens": 10**12}, 400, "exceed"),
    ("/v1/completions", {"model": "stub-model", "prompt": "a" * 1000}, 400, "context"),
    ("/v1/completions", {"model": "stub-model", "prompt": "a", "n": 3, "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"model": "stub-model", "prompt": "a", "echo": True, "stream": True}, 400, "echo"),
    ("/v1/completions", {"model": "stub-model", "prompt": "a", "max_tokens": 0}, 400, "echo"),
    ("/v1/completions", {"model": "stub-model", "prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"model": "stub-model", "prompt": "a", "suffix": "z"}, 400, "suffix"),
    ("/v1/chat/completions", {"model": "stub-model", "messages": [{"role": "user", "content": "a"}],
                              "response_format": {"type": "xml"}}, 400, "response_format"),
    ("/v1/chat/completions", {"model": "stub-model", "messages": [{"role": "user", "content": "a"}],
                              "response_format": {"type": "json_schema"}}, 400, "response_format"),
    ("/v1/completions", {"model": "stub-model", "prompt": "a", "regex": "[a"}, 400, "regex"),
    ("/v1/completions", {"model": "stub-model", "prompt": "a",
                         "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("/v1/chat/completions", {"model": "stub-model", "messages": [{"role": "user", "content": "a"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "'g'"),
    ("/v1/chat/completions", {"model": "stub-model", "messages": [{"role": "user", "content": "a"}],
                              "tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/chat/completions", {"model": "stub-model", "messages": [{"role": "user", "content": "a"}],
                              "top_logprobs": 3}, 400, "top_logprobs needs logprobs=true"),
    ("/v1/completions", {"model": "stub-model"}, 400, "prompt"),
    ("/v1/chat/completions", {"model": "stub-model", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "stub-model", "messages": [{"role": "wizard", "content": "a"}]}, 400, "role"),
    ("/v1/chat/completions", {"model": "stub-model", "messages": [
        {"role": "user", "content": [{"type": "image_url"}]}]}, 400, "image_url"),
    ("/v1/chat/completions", {"model": "stub-model", "messages": [{"role": "user", "content": "a"}],
                              "temperature": -0.1}, 400, "temperature"),
])
def test_openai_bad_input_is_4xx_with_a_message(server, path, body, status, fragment):
    client, engine = server
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    assert fragment in r.json()["error"]["message"]
    assert engine.submitted == []


def test_openai_client_whole_and_streamed(server):
    openai = pytest.importorskip("openai")
    client, _ = server
    oa = openai.OpenAI(base_url=str(client.base_url).rstrip("/") + "/v1", api_key="unused", max_retries=0)
    done = oa.chat.completions.create(model="stub-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert done.choices[0].message.content == " he" and done.usage.completion_tokens == 3
    streamed = "".join(c.choices[0].text for c in oa.completions.create(model="stub-model", prompt="hi",
                                                                         max_tokens=3, stream=True))
    assert streamed == " he"
    chat = oa.chat.completions.create(model="stub-model", messages=[{"role": "user", "content": "hi"}],
                                      max_tokens=3, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == " he"
    with pytest.raises(openai.NotFoundError):
        oa.completions.create(model="nope", prompt="hi")
