"""What a request is checked against (``NodeIdentity``: the node's role, context, model names, vocabulary) and the
checks that turn a request this node cannot serve into a 400 or 404 before the engine sees it: the model's name, the
prompt's and the token budget's lengths, token ids the model cannot embed.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsm_pd.api.errors import ApiError


@dataclass(frozen=True, slots=True)
class NodeIdentity:
    """What a request is checked against: the engine's role and context, the names it answers to."""

    role: str
    max_context: int
    model_names: frozenset[str]
    bootstrap_port: int | None  # this node's bootstrap port: the default for a request with bootstrap_port null
    vocab_size: int | None = None  # the model's vocabulary (token ids the model embeds), not the tokenizer's size
    max_token_bytes: int | None = None  # the most bytes of text one token stands for (None: unknown)


def check_model(node: NodeIdentity, model: str | None) -> None:
    if model is not None and model not in node.model_names:
        served = ", ".join(sorted(node.model_names))
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {served}", code="model_not_found")


def check_lengths(node: NodeIdentity, input_ids: list[int], max_new_tokens: int | None) -> int:
    """Checks the prompt and the token budget against the context; returns max_new_tokens (filled in when None)."""
    if not input_ids:
        raise ApiError(400, "the prompt is empty")
    if len(input_ids) >= node.max_context:
        raise ApiError(400, f"the prompt has {len(input_ids)} tokens; this model's context is {node.max_context} "
                            f"tokens (prompt and output together)")
    room = node.max_context - len(input_ids)
    if max_new_tokens is None:
        return room
    if max_new_tokens < 0:
        raise ApiError(400, f"max tokens must be at least 0, got {max_new_tokens}")
    if max_new_tokens > room:
        raise ApiError(400, f"{len(input_ids)} prompt tokens + {max_new_tokens} new tokens exceed this model's "
                            f"context of {node.max_context} tokens")
    return max_new_tokens


def check_text_length(node: NodeIdentity, text: str) -> None:
    """Refuse, before it is tokenized, a text that no tokenization fits in the context: each token stands for at
    most ``max_token_bytes`` of its bytes. (What passes is tokenized and counted exactly, ``check_lengths``.)"""
    if node.max_token_bytes is None or 4 * len(text) < node.max_context * node.max_token_bytes:
        return  # it fits whatever its characters (at most 4 bytes each)
    size = len(text.encode("utf-8", "surrogatepass"))
    fewest = -(-size // node.max_token_bytes)
    if fewest >= node.max_context:
        raise ApiError(400, f"the prompt's text is {size} bytes, at least {fewest} tokens (a token of this model "
                            f"stands for at most {node.max_token_bytes} bytes); this model's context is "
                            f"{node.max_context} tokens (prompt and output together)")


def check_token_ids(node: NodeIdentity, ids: list[int], what: str) -> None:
    """Ids must be ones the model can embed: its own output (the model's vocabulary can be larger than the
    tokenizer's, e.g. padded to a multiple of 64) is a valid prompt."""
    vocab = node.vocab_size
    bad = [i for i in ids if i < 0 or (vocab is not None and i >= vocab)]
    if bad:
        raise ApiError(400, f"{what} holds token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
