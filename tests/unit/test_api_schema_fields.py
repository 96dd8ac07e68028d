"""Never silently ignore: every field a request schema declares is read when the request is turned into engine
requests (served, or refused with a 400 that names it). A field added to a schema and forgotten fails here."""

from __future__ import annotations

import pytest
from stub_engine import stub_tokenizer

from fsm_pd.api import schemas
from fsm_pd.api.request_checks import NodeIdentity
from fsm_pd.api.requests import from_chat, from_completion, from_generate

NODE = NodeIdentity(role="colocated", max_context=512, model_names=frozenset({"m"}), bootstrap_port=None,
                    vocab_size=272)
# read outside the converters: by the routes (stream_options, echo: the answer's shape), the chat template
# (messages' role and content, parts' type and text), or deliberately unused (user: OpenAI's abuse-monitoring id)
READ_ELSEWHERE = {"stream_options", "user", "echo", "role", "content", "type", "text"}


def recorded(model_cls, reads: set[str]):
    """A subclass of ``model_cls`` whose attribute reads of declared fields land in ``reads``."""
    fields = set(model_cls.model_fields)

    class Recording(model_cls):
        def __getattribute__(self, name):
            if name in fields:
                reads.add(name)
            return super().__getattribute__(name)

    return Recording


@pytest.mark.parametrize("body_cls, convert, base", [
    (schemas.GenerateBody, from_generate, {"text": "a"}),
    (schemas.CompletionBody, from_completion, {"prompt": "a"}),
    (schemas.ChatCompletionBody, from_chat, {"messages": [{"role": "user", "content": "a"}]}),
])
def test_every_declared_field_is_read(body_cls, convert, base):
    reads: set[str] = set()
    nested: set[str] = set()
    body = recorded(body_cls, reads).model_validate(base)
    if body_cls is schemas.GenerateBody:
        body.sampling_params = recorded(schemas.SGLangSamplingParams, nested)()
    convert(NODE, stub_tokenizer(), body)
    unread = set(body_cls.model_fields) - reads - READ_ELSEWHERE
    assert not unread, f"{body_cls.__name__} accepts fields nobody reads: {sorted(unread)}"
    if body_cls is schemas.GenerateBody:
        unread = set(schemas.SGLangSamplingParams.model_fields) - nested
        assert not unread, f"sampling_params accepts fields nobody reads: {sorted(unread)}"


@pytest.mark.parametrize("body_cls, convert, body, kind", [
    (schemas.GenerateBody, from_generate, {"text": "a", "sampling_params": {"regex": "a+"}}, "regex"),
    (schemas.GenerateBody, from_generate, {"text": "a", "sampling_params": {"json_schema": "{}"}}, "json_schema"),
    (schemas.GenerateBody, from_generate, {"text": "a", "sampling_params": {"ebnf": 'root ::= "a"'}}, "ebnf"),
    (schemas.CompletionBody, from_completion, {"prompt": "a", "regex": "b"}, "regex"),
    (schemas.ChatCompletionBody, from_chat, {"messages": [{"role": "user", "content": "a"}],
                                             "response_format": {"type": "json_object"}}, "json_schema"),
])
def test_structured_output_fields_reach_the_sampler(body_cls, convert, body, kind):
    plan = convert(NODE, stub_tokenizer(), body_cls.model_validate(body))
    assert [r.sampling.grammar.kind for r in plan.requests] == [kind]
