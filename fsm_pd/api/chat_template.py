"""Chat messages to a prompt: the tokenizer's own template when the checkpoint has one, a plain default otherwise.

The default, for checkpoints without ``chat_template`` (base models), is one line per message, ``"<role>: <text>"``,
then ``"assistant:"`` to open the reply. It is not any model's training format; it only keeps chat usable.
"""

from __future__ import annotations

from fsm_pd.api.errors import ApiError
from fsm_pd.api.schemas import ChatMessage
from fsm_pd.engine.tokenizer import render_chat

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


def render_messages(template: str | None, messages: list[ChatMessage], extra: dict | None = None) -> tuple[str, bool]:
    """The prompt text, and whether the tokenizer should add its special tokens (a template writes its own)."""
    plain = [{"role": m.role, "content": message_text(m)} for m in messages]
    if template is None:
        lines = [f"{m['role']}: {m['content']}" for m in plain]
        return "\n".join([*lines, "assistant:"]), True
    extra = dict(extra or {})
    for reserved in ("messages", "add_generation_prompt"):
        extra.pop(reserved, None)
    try:
        return render_chat(template, plain, add_generation_prompt=True, **extra), False
    except RuntimeError:
        raise
    except Exception as err:  # a template's raise_exception (e.g. roles must alternate) or a Jinja error
        raise ApiError(400, f"the chat template refused these messages: {err}") from err
