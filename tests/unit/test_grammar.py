"""Structured output's grammar state with the tiny model's byte tokenizer: the mask it computes, how it advances,
when it completes, and the sampler's hook (greedy output under a schema always parses and validates)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import numpy as np
import pytest

from fsm_pd.model.grammar import ANY_JSON_OBJECT, GrammarSpec, bitmask, grammar_of, new_state
from fsm_pd.model.sampling import SamplingParams, sample
from fsm_pd.model.stopping import FinishReason, StopChecker
from fsm_pd.model.tokenizer import ByteTokenizer

TOK = ByteTokenizer(vocab_size=272)  # the tiny model's
EOS = set(TOK.eos_token_ids)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


def allowed(state, vocab=272) -> set[int]:
    mask = bitmask([state], 1, vocab)[0]
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab]
    return set(np.nonzero(bits)[0].tolist())


def ids(text: str) -> list[int]:
    return TOK.encode(text)


def test_regex_mask_allows_exactly_the_next_bytes_and_eos_only_when_complete():
    state = new_state(GrammarSpec("regex", "(yes|no)!*"), TOK)
    assert allowed(state) == set(ids("yn"))
    assert not state.advance(ord("y"))
    assert allowed(state) == {ord("e")}
    for c in "es":
        state.advance(ord(c))
    assert allowed(state) == {ord("!")} | EOS  # complete, and may go on
    assert state.advance(ord("!")) is False
    assert state.advance(TOK.eos_token_ids[0]) is True and state.error is None


def test_a_grammar_that_can_take_nothing_more_is_done_without_eos():
    state = new_state(GrammarSpec("ebnf", 'root ::= "ok" | "no"'), TOK)
    assert not state.advance(ord("o"))
    assert state.advance(ord("k")) is True
    assert allowed(state) == set()


def test_a_token_outside_the_grammar_breaks_it_and_ends_the_request():
    checker = StopChecker(TOK, SamplingParams(max_new_tokens=50, grammar=GrammarSpec("regex", "[0-9]+")))
    assert not checker.append(ord("7"))
    assert checker.append(ord("x"))  # the mask would have forbidden it: the request stops instead of going on
    assert checker.grammar.error and checker.finish_reason is FinishReason.STOP


def test_stop_checker_stops_when_the_grammar_completes():
    checker = StopChecker(TOK, SamplingParams(max_new_tokens=50, grammar=GrammarSpec("regex", "ab")))
    assert not checker.append(ord("a"))
    assert checker.append(ord("b"))
    assert (checker.finish_reason, checker.matched_stop, checker.text) == (FinishReason.STOP, None, "ab")


def test_eos_under_a_grammar_is_a_stop_token_as_usual():
    checker = StopChecker(TOK, SamplingParams(max_new_tokens=50, grammar=GrammarSpec("regex", "a+")))
    checker.append(ord("a"))
    assert checker.append(TOK.eos_token_ids[1])
    assert (checker.finish_reason, checker.matched_stop, checker.text) == (FinishReason.STOP, TOK.eos_token_ids[1], "a")


def run_greedy(params: SamplingParams, rng, vocab=272) -> StopChecker:
    checker = StopChecker(TOK, params)
    while not checker.finished:
        logits = rng.normal(size=(1, vocab)).astype(np.float32) * 4
        logits[0, list(EOS)] += 2  # an eager EOS, as a weak model's: the mask must hold it back until complete
        token = sample(logits, [params], [0], [len(checker.output_ids)], grammars=[checker.grammar])
        checker.append(int(token[0]))
    return checker


@pytest.mark.parametrize("seed", range(6))
def test_greedy_output_under_a_schema_parses_and_validates(seed):
    params = SamplingParams(temperature=0, max_new_tokens=200, grammar=GrammarSpec("json_schema", json.dumps(SCHEMA)))
    checker = run_greedy(params, np.random.default_rng(seed))
    assert checker.finish_reason is FinishReason.STOP, checker.text
    jsonschema.validate(json.loads(checker.text), SCHEMA)


def test_sampled_output_under_json_object_and_regex():
    rng = np.random.default_rng(1)
    params = SamplingParams(temperature=1.0, seed=3, max_new_tokens=300,
                            grammar=GrammarSpec("json_schema", json.dumps(
                                {"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"]})))
    assert isinstance(json.loads(run_greedy(params, rng).text)["k"], bool)
    params = SamplingParams(temperature=0.7, seed=3, max_new_tokens=30, grammar=GrammarSpec("regex", r"[a-c]{3}-\d"))
    text = run_greedy(params, rng).text
    assert len(text) == 5 and set(text[:3]) <= set("abc") and text[3] == "-" and text[4].isdigit()


def test_rows_without_a_grammar_sample_as_before_and_padding_ids_are_masked():
    rng = np.random.default_rng(2)
    vocab = 300  # wider than the tokenizer's 272, as a model's padded vocabulary
    logits = rng.normal(size=(3, vocab)).astype(np.float32)
    logits[:, 280] = 50  # a padding id the model likes best: no grammar row may take it
    params = [SamplingParams(temperature=0)] * 3
    plain = sample(logits, params, [0] * 3, [0] * 3)
    state = new_state(GrammarSpec("regex", "[xyz]"), TOK)
    masked = sample(logits, params, [0] * 3, [0] * 3, grammars=[None, state, None])
    assert plain[0] == plain[1] == plain[2] == 280
    assert masked[0] == masked[2] == 280 and chr(masked[1]) in "xyz"
    assert int(masked[1]) == max((ord(c) for c in "xyz"), key=lambda t: logits[1, t])
    assert sample(logits, params, [0] * 3, [0] * 3, grammars=[None] * 3).tolist() == plain.tolist()


def test_states_are_independent_copies():
    spec = GrammarSpec("regex", "ab|cd")
    one, two = new_state(spec, TOK), new_state(spec, TOK)
    one.advance(ord("a"))
    assert allowed(one) == {ord("b")} and allowed(two) == set(ids("ac"))


@pytest.mark.parametrize("fields, fragment", [
    ({"regex": "("}, "regex"),
    ({"regex": ""}, "regex"),
    ({"json_schema": "not json"}, "json_schema is not valid JSON"),
    ({"json_schema": '{"type": "strin"}'}, "json_schema"),
    ({"json_schema": "[1]"}, "json_schema must be a JSON object"),
    ({"ebnf": "root ::= other"}, "ebnf"),
    ({"regex": "a", "json_schema": "{}"}, "at most one"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_object"}, "regex": "a"}, "at most one"),
])
def test_bad_grammars_are_refused_naming_the_field(fields, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        grammar_of(SimpleNamespace(**fields))


def test_grammar_of_reads_every_form():
    assert grammar_of(SimpleNamespace()) is None
    assert grammar_of(SimpleNamespace(response_format={"type": "text"})) is None
    assert grammar_of(SimpleNamespace(regex="a+")) == GrammarSpec("regex", "a+")
    assert grammar_of(SimpleNamespace(response_format={"type": "json_object"})) == GrammarSpec(
        "json_schema", ANY_JSON_OBJECT)
    spec = grammar_of(SimpleNamespace(response_format={"type": "json_schema", "json_schema": {
        "name": "p", "schema": SCHEMA, "strict": True}}))
    assert spec.kind == "json_schema" and json.loads(spec.source) == SCHEMA
