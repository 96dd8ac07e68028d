"""Tokenizers: an HF ``tokenizer.json`` through the ``tokenizers`` library, and the byte-level one of the tiny model.

Both expose the same small surface the engine needs: ``encode``, ``decode``, ``eos_token_ids``, ``chat_template``
and ``vocab_size``.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    chat_template: str | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


# Texts longer than this are encoded through ``encode_batch``, which lets go of the interpreter's lock while it
# works (``encode`` holds it: 1.5 MB of text took SmolLM2's tokenizer 1.2 s, and every other thread of the node, its
# event loop and model thread included, waited); shorter ones take ``encode``, a little quicker.
GIL_FREE_CHARS = 8192


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` plus the EOS ids and chat template read from the checkpoint's side files."""

    def __init__(self, inner, *, eos_token_ids: tuple[int, ...], chat_template: str | None) -> None:
        self._inner = inner
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        self.vocab_size = inner.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > GIL_FREE_CHARS:  # the same ids, without holding the lock (checked in test_tokenizer_limits)
            return self._inner.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._inner.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._inner.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def max_token_bytes(self) -> int | None:
        """The most UTF-8 bytes of text one token stands for, so a text of B bytes is at least B / this many
        tokens, known before it is tokenized; None when a normalizer may shrink text before it is split (the bound
        would not hold). A piece of a character decodes to U+FFFD (3 bytes), which only loosens the bound."""
        if self._inner.normalizer is not None:
            return None
        pieces = self._inner.decode_batch([[i] for i in range(self.vocab_size)], skip_special_tokens=False)
        return max((len(piece.encode("utf-8")) for piece in pieces), default=1) or 1

    def token_to_id(self, token: str) -> int | None:
        return self._inner.token_to_id(token)


def load_hf_tokenizer(directory: Path, *, config_eos_ids: tuple[int, ...] = ()) -> HFTokenizer:
    """Read ``tokenizer.json`` and, when present, ``tokenizer_config.json``, ``chat_template.jinja`` and
    ``generation_config.json`` from a checkpoint directory.

    EOS ids come from ``generation_config.json`` (what HF ``generate`` stops on), else ``config.json``, else the
    ``eos_token`` named in ``tokenizer_config.json``.
    """
    from tokenizers import Tokenizer as RawTokenizer

    path = directory / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: fsm-pd needs a fast-tokenizer tokenizer.json in the checkpoint")
    inner = RawTokenizer.from_file(str(path))
    tok_config = _read_json(directory / "tokenizer_config.json")
    gen_config = _read_json(directory / "generation_config.json")

    eos = _id_tuple(gen_config.get("eos_token_id")) or config_eos_ids
    if not eos and tok_config.get("eos_token") is not None:
        name = tok_config["eos_token"]
        token_id = inner.token_to_id(name["content"] if isinstance(name, dict) else name)
        eos = () if token_id is None else (token_id,)
    return HFTokenizer(inner, eos_token_ids=eos, chat_template=_chat_template(directory, tok_config))


def _chat_template(directory: Path, tok_config: dict) -> str | None:
    jinja_file = directory / "chat_template.jinja"  # where transformers >= 4.5x saves it
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # several named templates: the unnamed or "default" one is the chat template
        named = {t.get("name", "default"): t.get("template") for t in template}
        template = named.get("default")
    return template


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _id_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)


class ByteTokenizer:
    """Token ``i < 256`` is byte ``i``; special tokens follow. No download, no merges, every string round-trips."""

    SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")

    def __init__(self, vocab_size: int, chat_template: str | None = None) -> None:
        if vocab_size < 256 + len(self.SPECIALS):
            raise ValueError(f"a byte tokenizer needs a vocab of at least {256 + len(self.SPECIALS)}")
        self.vocab_size = vocab_size
        self.special_ids = {name: 256 + i for i, name in enumerate(self.SPECIALS)}
        self._special_names = {i: name for name, i in self.special_ids.items()}
        self.eos_token_ids = (self.special_ids["<|endoftext|>"], self.special_ids["<|im_end|>"])
        self.chat_template = chat_template
        self._split = re.compile("(" + "|".join(re.escape(s) for s in self.SPECIALS) + ")")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # add_special_tokens is accepted for interface parity: this tokenizer adds no BOS.
        ids: list[int] = []
        for part in self._split.split(text):
            if part in self.special_ids:
                ids.append(self.special_ids[part])
            else:
                ids.extend(part.encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for i in ids:
            i = int(i)
            if i < 256:
                out.append(i)
            elif i in self._special_names and not skip_special_tokens:
                out.extend(self._special_names[i].encode("utf-8"))
        # A generation cut mid-character decodes to U+FFFD rather than failing; the next token completes it.
        return out.decode("utf-8", errors="replace")

    def token_to_id(self, token: str) -> int | None:
        return self.special_ids.get(token)

    @property
    def max_token_bytes(self) -> int:
        """The most bytes of text one token stands for: a special token's name."""
        return max(len(name.encode("utf-8")) for name in self.SPECIALS)


def render_chat(template: str, messages: list[dict], *, add_generation_prompt: bool = True, **extra) -> str:
    """Render a chat template the way HF does (Jinja2, ``messages`` and ``add_generation_prompt`` in scope)."""
    return compiled_template(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **extra)


@functools.lru_cache(maxsize=16)
def compiled_template(template: str):
    """``template`` compiled once per process, not per request: compiling SmolLM2's template is pure Python that took
    4-5 ms of a request's 5 ms of planning (11 of 12 under cProfile) while holding the interpreter's lock, and a
    ``--role pd`` request's two legs each planned it. A compiled Jinja template renders from any thread."""
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as err:  # jinja2 comes with transformers; the engine itself does not need it
        raise RuntimeError("rendering a chat template needs jinja2 (pip install jinja2)") from err

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)
