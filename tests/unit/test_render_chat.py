"""``model/tokenizer.render_chat``: a chat template is compiled once per process, then rendered per request, with
what a fresh compile renders."""

from __future__ import annotations

from unittest import mock

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from fsm_pd.model.tokenizer import compiled_template, render_chat

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
STRICT = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
          "{{ messages[0]['content'] }}")


def fresh(template: str, **context) -> str:
    """What a compile of its own renders (the behaviour before the cache)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(**context)


def test_a_template_is_compiled_once_and_renders_what_a_fresh_compile_does():
    compiled_template.cache_clear()
    asked = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": f"question {n}"}]
             for n in range(3)]
    compile_ = jinja2.Environment.compile
    with mock.patch.object(jinja2.Environment, "compile", autospec=True, side_effect=compile_) as compiles:
        rendered = [render_chat(TEMPLATE, messages) for messages in asked]
        assert compiles.call_count == 1
        render_chat(TEMPLATE + " ", [{"role": "user", "content": "x"}])  # another template: its own compile
        assert compiles.call_count == 2
    assert rendered == [fresh(TEMPLATE, messages=messages, add_generation_prompt=True) for messages in asked]
    assert rendered[2] == "<|system|>be brief\n<|user|>question 2\n<|assistant|>"
    assert render_chat(TEMPLATE, [{"role": "user", "content": "x"}], add_generation_prompt=False) == "<|user|>x\n"


def test_the_cached_template_still_raises_what_the_template_raises():
    assert render_chat(STRICT, [{"role": "user", "content": "hi"}]) == "hi"
    for _ in range(2):
        with pytest.raises(jinja2.exceptions.TemplateError, match="user first"):
            render_chat(STRICT, [{"role": "system", "content": "hi"}])
