"""Structured output through a real PD pair (tiny model) behind the built-in router, next to a colocated node: the
prefill node masks the first token with the request's grammar, the decode node rebuilds the grammar from the same
body and advances it with READY's first token before its first step. Greedy output under a JSON schema parses and
validates; a regex request matches; OpenAI's response_format json_schema does too.

The test process's shared PD cluster (``conftest.pd_urls``: processes started there, stopped by PID); everything on
127.0.0.1.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from processes import post_ok

# one xdist worker runs every module on the shared PD cluster (conftest.pd_urls), so that a run starts it once
pytestmark = pytest.mark.xdist_group("shared-pd")

TIMEOUT_S = 180
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "pets": {"type": "array", "items": {"enum": ["cat", "dog"]},
                                                    "maxItems": 3}},
          "required": ["name", "age", "pets"], "additionalProperties": False}
GREEDY = {"temperature": 0, "max_new_tokens": 120}


@pytest.fixture(scope="module")
def urls(pd_urls):
    """The test process's shared PD cluster (``conftest.pd_urls``): these tests only send requests and compare."""
    return pd_urls


def generate(url: str, body: dict) -> dict | list:
    return post_ok(url, "/generate", body, TIMEOUT_S)


@pytest.mark.parametrize("prompt", ["Describe a person as JSON:", "zz", "{\"name\": 1"])
def test_json_schema_greedy_output_parses_and_validates_through_pd(urls, prompt):
    body = {"text": prompt, "sampling_params": {**GREEDY, "json_schema": json.dumps(SCHEMA)}}
    out = generate(urls["router"], body)
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    jsonschema.validate(json.loads(out["text"]), SCHEMA)
    assert out["text"] == generate(urls["colocated"], body)["text"]  # the same parser, the same tokens


def test_regex_output_matches_through_pd_whole_and_streamed(urls):
    pattern = r"(red|green|blue)-[0-9]{2,4}"
    body = {"text": "a colour code:", "sampling_params": {**GREEDY, "regex": pattern}}
    text = generate(urls["router"], body)["text"]
    assert re.fullmatch(pattern, text), text
    with httpx.stream("POST", urls["router"] + "/generate", json={**body, "stream": True}, timeout=TIMEOUT_S) as r:
        assert r.status_code == 200
        chunks = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
    assert json.loads(chunks[-2])["text"] == text


def test_ebnf_output_follows_the_grammar_through_pd(urls):
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'
    out = generate(urls["router"], {"text": "Q?", "sampling_params": {**GREEDY, "ebnf": grammar}})
    assert out["text"] in ("The answer is yes.", "The answer is no."), out


def test_openai_response_format_json_schema_through_pd(urls):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Give me a person."}], "temperature": 0,
            "max_tokens": 120, "response_format": {"type": "json_schema",
                                                   "json_schema": {"name": "person", "schema": SCHEMA}}}
    r = httpx.post(urls["router"] + "/v1/chat/completions", json=body, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    # json_object bounds nothing: the tiny model's random weights may write one key until max_tokens, so the
    # answer is a JSON object when it stopped, and the start of one when it ran out of tokens.
    r = httpx.post(urls["router"] + "/v1/chat/completions", timeout=TIMEOUT_S,
                   json={**body, "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["message"]["content"]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(content), dict), content
    else:
        assert choice["finish_reason"] == "length" and content.startswith("{"), choice


def test_a_bad_grammar_is_a_400_naming_it(urls):
    r = httpx.post(urls["router"] + "/generate", json={"text": "a", "sampling_params": {"regex": "(unclosed"}},
                   timeout=TIMEOUT_S)
    assert r.status_code == 400 and "regex" in r.json()["error"]["message"], r.text
