"""Structured output: a grammar per request (a JSON schema, a regex or an EBNF grammar) that masks the logits before
each token is sampled and is fed every sampled token, through llguidance (``docs/structured-output.md`` says why
that library).

A ``GrammarSpec`` is what the request asked for; it is part of the request's ``SamplingParams``, so both PD nodes,
which get the same body from the router, rebuild the same grammar. A ``GrammarState`` is one request's position in
it: the prefill node builds one for the first token only; the decode (or colocated) node builds its own in the
request's ``StopChecker`` and advances it with READY's first token before its first step, so the two never have to
exchange parser state. The request ends (as a stop) once the grammar can take no more bytes.
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import numpy as np

log = logging.getLogger(__name__)

KINDS = ("json_schema", "regex", "ebnf")
# Compact JSON with Python's separators: with flexible whitespace a weak model can emit blanks until max_tokens and
# never close the object. A schema's own "x-guidance" options still override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT = '{"type": "object"}'  # OpenAI's response_format json_object: a JSON object, any keys
MAX_GRAMMAR_CHARS = 64 * 1024  # a request's grammar source; larger ones are refused before anything compiles
_PRISTINE_CACHE = 64  # compiled grammars kept (per tokenizer), so the next request with the same one copies it


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """One request's constraint: ``kind`` is ``json_schema``, ``regex`` or ``ebnf``; ``source`` its text. Checked
    on creation (``ValueError`` naming the field), before the request can reach a node's batch."""

    kind: str
    source: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.source, str) or not self.source.strip():
            raise ValueError(f"{self.kind} must be a non-empty string")
        if len(self.source) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"{self.kind} is {len(self.source)} characters; at most {MAX_GRAMMAR_CHARS}")
        error = llguidance.LLMatcher.validate_grammar(self.compiled())
        if error:
            raise ValueError(f"{self.kind} is not a grammar fsm-pd can follow: {error.strip()}")

    def compiled(self) -> str:
        """The llguidance grammar (its own JSON form)."""
        return _llg_grammar(self.kind, self.source)


def _llg_grammar(kind: str, source: str) -> str:
    if kind == "json_schema":
        try:
            schema = json.loads(source)
        except json.JSONDecodeError as err:
            raise ValueError(f"json_schema is not valid JSON: {err}") from None
        if not isinstance(schema, dict | bool):
            raise ValueError("json_schema must be a JSON object (a schema)")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(source)
    try:  # SGLang's ebnf is GBNF (llama.cpp's, as xgrammar reads it); a Lark grammar is taken as it is
        return llguidance.grammar_from("ebnf", source)
    except ValueError as err:
        raise ValueError(f"ebnf: {err}") from None


def grammar_of(src) -> GrammarSpec | None:
    """The grammar a request body asks for: SGLang's ``json_schema``, ``regex``, ``ebnf`` (in sampling_params, or
    as extensions on an OpenAI body) or OpenAI's ``response_format``; at most one. ``ValueError`` names the field."""
    asked = {kind: getattr(src, kind, None) for kind in KINDS}
    response_format = getattr(src, "response_format", None)
    from_format = _from_response_format(response_format) if response_format is not None else None
    given = [k for k, v in asked.items() if v is not None] + (["response_format"] if from_format else [])
    if len(given) > 1:
        raise ValueError(f"at most one of json_schema, regex, ebnf, response_format; got {', '.join(given)}")
    if from_format:
        return from_format
    for kind, source in asked.items():
        if source is not None:
            return GrammarSpec(kind, source)
    return None


def _from_response_format(fmt) -> GrammarSpec | None:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_schema", ANY_JSON_OBJECT)
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        schema = inner.get("schema") if isinstance(inner, dict) else None
        if not isinstance(schema, dict):
            raise ValueError("response_format.json_schema.schema must be a JSON schema object")
        return GrammarSpec("json_schema", json.dumps(schema))
    raise ValueError(f"response_format.type must be text, json_object or json_schema, got {kind!r}")


class GrammarState:
    """One request's parser: ``fill_mask`` before a token is sampled, ``advance`` with the token sampled."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: int) -> None:
        self._matcher = matcher
        self.vocab = vocab  # the tokenizer's; ids at or above it are never allowed
        self.words = (vocab + 31) // 32

    def fill_mask(self, row: np.ndarray) -> None:
        """Write the allowed tokens of the next step into ``row`` (int32, ``words`` of 32 bits, bit i = token i)."""
        if self.done:  # nothing more may follow: allow nothing but what ends it (the checker has finished already)
            row[:] = 0
            return
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def advance(self, token_id: int) -> bool:
        """Feed one sampled token; True once the grammar is complete (or broken) and the request should stop."""
        if not self._matcher.is_stopped() and not self._matcher.consume_token(int(token_id)):
            log.warning("token %d is outside the request's grammar: %s", token_id, self._matcher.get_error())
        return self.done

    @property
    def done(self) -> bool:
        return self._matcher.is_stopped() or self._matcher.is_error()

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None


class _Compiled:
    """A tokenizer's llguidance form, and its recently compiled grammars to copy from."""

    def __init__(self, tokenizer) -> None:
        self.ll_tokenizer = _ll_tokenizer(tokenizer)
        self.vocab = self.ll_tokenizer.vocab_size
        self.pristine: OrderedDict[GrammarSpec, llguidance.LLMatcher] = OrderedDict()
        self.lock = threading.Lock()


_by_tokenizer: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_by_tokenizer_lock = threading.Lock()


def new_state(spec: GrammarSpec, tokenizer) -> GrammarState:
    """A fresh parser for ``spec`` over ``tokenizer``'s vocabulary; any thread."""
    with _by_tokenizer_lock:
        compiled = _by_tokenizer.get(tokenizer)
        if compiled is None:
            compiled = _by_tokenizer[tokenizer] = _Compiled(tokenizer)
    with compiled.lock:
        pristine = compiled.pristine.get(spec)
        if pristine is None:
            pristine = llguidance.LLMatcher(compiled.ll_tokenizer, spec.compiled(), log_level=0)
            if pristine.is_error():
                raise ValueError(f"{spec.kind}: {pristine.get_error()}")
            compiled.pristine[spec] = pristine
            while len(compiled.pristine) > _PRISTINE_CACHE:
                compiled.pristine.popitem(last=False)
        compiled.pristine.move_to_end(spec)
        return GrammarState(pristine.deep_copy(), compiled.vocab)


def bitmask(states: Sequence[GrammarState | None], rows: int, vocab: int) -> np.ndarray | None:
    """``[rows, ceil(vocab / 32)]`` int32 of allowed tokens (bit i of word w: token 32 w + i) for the sampler's
    logits of width ``vocab``; rows without a grammar allow everything. None when no row has a grammar."""
    if all(s is None for s in states):
        return None
    words = (vocab + 31) // 32
    mask = np.full((rows, words), -1, dtype=np.int32)
    for b, state in enumerate(states):
        if state is None:
            continue
        if state.words == words:
            state.fill_mask(mask[b])
        else:  # the model's vocabulary is wider (padded) or narrower than the tokenizer's
            row = np.zeros(state.words, dtype=np.int32)
            state.fill_mask(row)
            mask[b] = 0
            n = min(words, state.words)
            mask[b, :n] = row[:n]
    return mask


def _ll_tokenizer(tokenizer) -> llguidance.LLTokenizer:
    eos = list(tokenizer.eos_token_ids)
    inner = getattr(tokenizer, "_inner", None)  # an HFTokenizer: llguidance reads the same tokenizer.json
    if inner is not None:
        return llguidance.LLTokenizer(inner.to_str(), eos_token=eos or None)
    if hasattr(tokenizer, "special_ids"):  # the tiny model's ByteTokenizer
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocab(tokenizer)),
                                      n_vocab=tokenizer.vocab_size, eos_token=eos)
    raise ValueError(f"structured output needs an HF or byte tokenizer, not {type(tokenizer).__name__}")


class _ByteVocab:
    """What ``llguidance.TokenizerWrapper`` reads from a ByteTokenizer: each id's bytes (specials marked with 0xFF,
    as llguidance expects; the unused ids after them are specials that never decode) and an encoder."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        names = {i: name for name, i in tokenizer.special_ids.items()}
        self.tokens = [bytes([i]) for i in range(256)] + [
            b"\xff" + names.get(i, f"<|unused{i}|>").encode() for i in range(256, tokenizer.vocab_size)]
        self.special_token_ids = list(range(256, tokenizer.vocab_size))
        self.eos_token_id = tokenizer.eos_token_ids[0]
        self.bos_token_id = None

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text) if isinstance(text, bytes) else self._tokenizer.encode(text)
