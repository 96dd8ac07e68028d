"""The tie-tolerant comparison of greedy outputs accepts a split only at a real tie of the tiny model."""

import pytest
from greedy_ties import split_at_a_tie, tiny_prompt_ids

# the tie gaps are float32 differences of logits (4.8e-7 apart): at full precision on a TPU too (tests/on_chip.py)
pytestmark = pytest.mark.usefixtures("full_precision")


def test_equal_outputs_match():
    prompt = tiny_prompt_ids("stream 0: the quick brown fox")
    assert split_at_a_tie(prompt, [176, 124, 124], [176, 124, 124]) is None


def test_a_split_where_two_tokens_tie_is_arithmetic():
    # after this prompt tokens 106 and 22 are 4.8e-7 apart: a CI run under load took 22, a quiet one 106
    prompt = tiny_prompt_ids("stream 20: the quick brown fox")
    assert split_at_a_tie(prompt, [106, 124, 124], [22, 124, 163]) is None


def test_a_split_with_a_clear_winner_is_reported():
    prompt = tiny_prompt_ids("stream 0: the quick brown fox")  # 176 leads 22 by 0.145
    found = split_at_a_tie(prompt, [176, 124], [22, 124])
    assert found is not None and found.startswith("token 0: 176 and 22")


def test_a_split_after_an_equal_prefix_is_judged_there():
    prompt = tiny_prompt_ids("stream 20: the quick brown fox")
    found = split_at_a_tie(prompt, [106, 124, 124], [106, 124, 3])
    assert found is not None and found.startswith("token 2:")


def test_outputs_of_different_lengths_do_not_match():
    prompt = tiny_prompt_ids("stream 0: the quick brown fox")
    assert split_at_a_tie(prompt, [176, 124], [176]) == "lengths differ: 2 and 1"
