"""Tool calling: the parsers on hand-written model outputs (Qwen's <tool_call> blocks, Llama 3's JSON objects),
malformed ones included, which must stay plain content; the streaming hold-back; the prompt; and the chat route over a
stub engine whose scripted reply is a call (whole and streamed)."""

from __future__ import annotations

import json

import httpx
import pytest
from real_parts import TCP
from stub_engine import stub_server

from fsm_pd.api.chat_template import render_messages
from fsm_pd.api.schemas import ChatMessage, ToolDef
from fsm_pd.api.tools import LLAMA3, QWEN, ToolPlan, ToolStreamer, parse_tool_calls, template_format

QWEN_PLAN = ToolPlan(QWEN, frozenset({"get_weather", "get_time"}))
LLAMA_PLAN = ToolPlan(LLAMA3, frozenset({"get_weather", "get_time"}))
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def calls_of(text: str, plan: ToolPlan) -> tuple[str | None, list[tuple[str, dict]]]:
    content, calls = parse_tool_calls(text, plan)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_qwen_calls_are_parsed_with_the_content_before_them():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}\n</tool_call>')
    content, calls = calls_of(text, QWEN_PLAN)
    assert content == "Let me check."
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert calls_of(text, ToolPlan(QWEN, QWEN_PLAN.names, parallel=False))[1] == [("get_weather", {"city": "Paris"})]
    only = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert calls_of(only, QWEN_PLAN) == (None, [("get_time", {})])


@pytest.mark.parametrize("text", [
    "The weather in Paris is fine.",  # no call at all
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}</tool_call>',  # bad JSON
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}',  # never closed
    '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>',  # a function nobody offered
    '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>',  # no name
    '<tool_call>{"name": "get_weather", "arguments": [1, 2]}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> and <tool_call>{"name": "x"}</tool_call>',
])
def test_malformed_qwen_output_stays_plain_content(text):
    assert parse_tool_calls(text, QWEN_PLAN) == (text, [])


def test_llama3_calls_are_parsed():
    one = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert calls_of(one, LLAMA_PLAN) == (None, [("get_weather", {"city": "Paris"})])
    assert calls_of("<|python_tag|>" + one, LLAMA_PLAN)[1] == [("get_weather", {"city": "Paris"})]
    two = '{"name": "get_weather", "parameters": {"city": "a;b"}}; {"name": "get_time", "parameters": {}}'
    assert calls_of(two, LLAMA_PLAN)[1] == [("get_weather", {"city": "a;b"}), ("get_time", {})]


@pytest.mark.parametrize("text", [
    "Paris is sunny today.",
    '{"name": "get_weather", "parameters": {"city": "Paris"}',  # cut short
    '{"name": "nobody", "parameters": {}}',
    'Sure: {"name": "get_weather", "parameters": {"city": "Paris"}}',  # a call must be the whole answer
    '{"city": "Paris"}',
])
def test_malformed_llama3_output_stays_plain_content(text):
    assert parse_tool_calls(text, LLAMA_PLAN) == (text, [])


def stream(text: str, plan: ToolPlan, step: int = 3) -> tuple[list[str], ToolStreamer]:
    streamer = ToolStreamer(plan)
    sent = [streamer.feed(text[i:i + step]) for i in range(0, len(text), step)]
    sent.append(streamer.finish())
    return [s for s in sent if s], streamer


@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_qwen_content_goes_out_at_once_and_the_call_at_the_end(step):
    text = 'Checking now.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    sent, streamer = stream(text, QWEN_PLAN, step)
    assert "".join(sent) == "Checking now.\n"
    assert [(c.name, json.loads(c.arguments)) for c in streamer.calls] == [("get_weather", {"city": "Oslo"})]
    assert len(sent) > 1 or step > 10  # content was streamed as it came, not all at the end


@pytest.mark.parametrize("text", [
    "a <tool is not a call, <tool_call> alone neither",
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}',  # cut off by max_tokens
    "ends with a prefix <tool_ca",
])
def test_streamed_malformed_output_is_all_content(text):
    sent, streamer = stream(text, QWEN_PLAN)
    assert "".join(sent) == text and streamer.calls == []


def test_streamed_llama3_holds_back_only_what_may_be_a_call():
    sent, streamer = stream("Plain answer, streamed.", LLAMA_PLAN)
    assert "".join(sent) == "Plain answer, streamed." and len(sent) > 1 and streamer.calls == []
    sent, streamer = stream('  {"name": "get_time", "parameters": {}}', LLAMA_PLAN)
    assert sent == [] and [c.name for c in streamer.calls] == ["get_time"]
    sent, streamer = stream('{"not": "a call"}', LLAMA_PLAN)
    assert "".join(sent) == '{"not": "a call"}' and streamer.calls == []


def test_format_follows_the_template():
    assert template_format("{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>") == (QWEN, True)
    llama = '{% if tools %}Respond in the format {"name": function name, "parameters": dictionary}{% endif %}'
    assert template_format(llama) == (LLAMA3, True)
    assert template_format("{{ messages }}") == (QWEN, False)
    assert template_format(None) == (QWEN, False)


def test_the_template_receives_tools_else_a_system_message_describes_them():
    tools = [ToolDef.model_validate(WEATHER).model_dump(exclude_none=True)]
    messages = [ChatMessage(role="user", content="Weather in Paris?")]
    template = "{% for t in tools %}TOOL {{ t.function.name }};{% endfor %}{% for m in messages %}{{ m.content }}" \
               "{% endfor %}"
    prompt, _ = render_messages(template, messages, None, tools)
    assert prompt == "TOOL get_weather;Weather in Paris?"
    chatml = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    prompt, _ = render_messages(chatml, messages, None, tools)
    assert prompt.startswith("<system>") and '"name": "get_weather"' in prompt and "<tool_call>" in prompt
    assert prompt.endswith("<user>Weather in Paris?")


def test_earlier_calls_reach_the_template_with_their_arguments_as_objects():
    messages = [ChatMessage(role="assistant", content=None, tool_calls=[
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]),
        ChatMessage(role="tool", content="sunny", tool_call_id="c1")]
    template = "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.arguments.city }}{% endfor %}" \
               "{{ m.tool_call_id or '' }}{% endfor %}"
    assert render_messages(template, messages, None, None)[0] == "Romec1"


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'


@pytest.fixture
def caller():
    with stub_server("colocated", reply=CALL) as (url, engine):
        yield url


def chat(url: str, **extra) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER], "max_tokens": 100,
            **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=30)


@TCP
def test_chat_answers_tool_calls(caller):
    choice = chat(caller).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    plain = chat(caller, tool_choice="none").json()["choices"][0]  # none: the text as it is
    assert plain["finish_reason"] == "stop" and plain["message"]["content"].startswith("<tool_call>")
    assert "tool_calls" not in plain["message"]


@TCP
def test_streamed_chat_sends_a_tool_calls_delta(caller):
    with httpx.stream("POST", caller + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER], "stream": True}) as r:
        chunks = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:") and "[DONE]" not in line]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert not any(d.get("content") for d in deltas)  # the call was held back, never shown as text
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert len(calls) == 1 and calls[0][0]["index"] == 0 and calls[0][0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0][0]["function"]["arguments"]) == {"city": "Paris"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
