"""Chat messages to a prompt: the tokenizer's own template when the checkpoint has one, a plain default otherwise.

The default, for checkpoints without ``chat_template`` (base models), is one line per message, ``"<role>: <text>"``,
then ``"assistant:"`` to open the reply. It is not any model's training format; it only keeps chat usable.
"""

from __future__ import annotations

import json

from fsm_pd.api.errors import ApiError
from fsm_pd.api.schemas import ChatMessage
from fsm_pd.api.tools import fallback_system_text, template_format
from fsm_pd.model.tokenizer import render_chat

DEFAULT_TEMPLATE_DOC = 'one "<role>: <text>" line per message, then "assistant:"'


def message_text(message: ChatMessage) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise ApiError(400, f"message content part of type {part.type!r} is not supported (text only)")
        texts.append(part.text)
    return "".join(texts)


def template_message(message: ChatMessage) -> dict:
    """A message as HF chat templates read it; an assistant's earlier calls with their arguments as objects (the
    templates write them with ``tojson``; OpenAI sends them as JSON text)."""
    out = {"role": message.role, "content": message_text(message)}
    if message.tool_calls:
        calls = []
        for call in message.tool_calls:
            function = dict(call.get("function") or {})
            if isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except ValueError:
                    raise ApiError(400, "messages: a tool call's arguments are not JSON") from None
            calls.append({**call, "function": function})
        out["tool_calls"] = calls
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def with_tool_system_text(messages: list[dict], tools: list[dict]) -> list[dict]:
    """For a template that does not render tools: fsm-pd's own description of them, in the system message."""
    text = fallback_system_text(tools)
    if messages and messages[0]["role"] in ("system", "developer"):
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def render_messages(template: str | None, messages: list[ChatMessage], extra: dict | None = None,
                    tools: list[dict] | None = None) -> tuple[str, bool]:
    """The prompt text, and whether the tokenizer should add its special tokens (a template writes its own).
    ``tools``: given to the template as ``tools`` when it renders them, else described in the system message."""
    plain = [template_message(m) for m in messages]
    if tools and not template_format(template)[1]:
        plain, tools = with_tool_system_text(plain, tools), None
    if template is None:
        lines = [f"{m['role']}: {m['content']}" for m in plain]
        return "\n".join([*lines, "assistant:"]), True
    extra = dict(extra or {})
    for reserved in ("messages", "add_generation_prompt", "tools"):
        extra.pop(reserved, None)
    try:
        if tools:
            extra["tools"] = tools
        return render_chat(template, plain, add_generation_prompt=True, **extra), False
    except RuntimeError:
        raise
    except Exception as err:  # a template's raise_exception (e.g. roles must alternate) or a Jinja error
        raise ApiError(400, f"the chat template refused these messages: {err}") from err
