"""Token sampling with per-row parameters, and the stop conditions."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from fsm_pd.model.sampling import SamplingParams, sample
from fsm_pd.model.stopping import FinishReason, StopChecker
from fsm_pd.model.tokenizer import ByteTokenizer

# device programs: on a TPU host they run in the process that holds the chip (tests/on_tpu.sh)
pytestmark = pytest.mark.chip

VOCAB = 40


def random_logits(rows, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(rows, VOCAB)).astype(np.float32) * 3)


def test_greedy_is_argmax_and_ignores_the_seed():
    logits = random_logits(5)
    params = [SamplingParams(temperature=0)] * 5
    got = sample(logits, params, seeds=[1, 2, 3, 4, 5], steps=[0, 9, 3, 1, 2])
    np.testing.assert_array_equal(got, np.argmax(np.asarray(logits), axis=1))


def test_top_k_one_and_tiny_top_p_are_greedy_at_any_temperature():
    logits = random_logits(4, seed=1)
    params = [SamplingParams(temperature=5.0, top_k=1)] * 2 + [SamplingParams(temperature=5.0, top_p=1e-6)] * 2
    got = sample(logits, params, seeds=[1, 2, 3, 4], steps=[0, 0, 0, 0])
    np.testing.assert_array_equal(got, np.argmax(np.asarray(logits), axis=1))


def test_same_seed_and_step_give_the_same_token_whatever_the_batch():
    flat = jnp.zeros((1, VOCAB))  # uniform, so a wrong key would show as a different token almost surely
    mine = SamplingParams(seed=11)
    alone = [sample(flat, [mine], seeds=[11], steps=[step])[0] for step in range(8)]
    others = [SamplingParams(temperature=0.7)] * 4
    in_batch = []
    for step in range(8):
        logits = jnp.concatenate([random_logits(2, seed=step), flat, random_logits(2, seed=step + 50)])
        got = sample(logits, others[:2] + [mine] + others[2:], seeds=[5, 6, 11, 7, 8], steps=[0, 1, step, 2, 3])
        in_batch.append(got[2])
    assert in_batch == alone
    assert len(set(alone)) > 1


# The statistical tests below sample batches of ROWS, each checking its first ``rows``: one sampler program for the
# three (on a chip each took about 2 s to compile). A row's token depends on its own logits, seed and step alone
# (``test_same_seed_and_step_give_the_same_token_whatever_the_batch``), so those rows are what a batch of ``rows``
# draws.
ROWS = 1024


def sample_rows(rows: int, logits: np.ndarray, params: SamplingParams, seed: int) -> np.ndarray:
    """``rows`` tokens, row ``i`` at step ``i``, of ``logits`` (``[V]``: every row's) sampled in a batch of ROWS."""
    batch = np.tile(np.asarray(logits, np.float32), (ROWS, 1))
    return np.asarray(sample(batch, [params] * ROWS, seeds=[seed] * ROWS, steps=list(range(ROWS))))[:rows]


def test_different_steps_explore_different_tokens():
    got = sample_rows(64, np.zeros(VOCAB), SamplingParams(seed=3), seed=3)  # uniform: every token equally likely
    assert len(set(got.tolist())) > 20


def test_top_k_and_top_p_restrict_the_support():
    rows = 256
    base = np.asarray(random_logits(1, seed=5))[0]
    ranked = np.argsort(-base)
    top3 = sample_rows(rows, base, SamplingParams(top_k=3, seed=1), seed=1)
    assert set(top3.tolist()) <= set(ranked[:3].tolist())
    assert len(set(top3.tolist())) >= 2
    probs = np.exp(base - base.max()) / np.exp(base - base.max()).sum()
    nucleus = int(np.searchsorted(np.cumsum(probs[ranked]), 0.8) + 1)  # tokens needed to reach 0.8 of the mass
    top_p = sample_rows(rows, base, SamplingParams(top_p=0.8, seed=2), seed=2)
    assert set(top_p.tolist()) <= set(ranked[:nucleus].tolist())


def test_temperature_sampling_follows_the_softmax():
    rows = ROWS
    got = sample_rows(rows, np.log([0.6, 0.3, 0.1] + [1e-9] * (VOCAB - 3)), SamplingParams(temperature=1.0), seed=9)
    freq = np.bincount(got, minlength=3)[:3] / rows
    np.testing.assert_allclose(freq, [0.6, 0.3, 0.1], atol=0.05)  # binomial sd <= 0.016 at n=1024


def test_sampling_params_validation():
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(seed=5).resolved_seed() == 5


TOK = ByteTokenizer(vocab_size=272)
EOS = TOK.special_ids["<|endoftext|>"]


def feed(checker, text_or_ids):
    ids = TOK.encode(text_or_ids) if isinstance(text_or_ids, str) else text_or_ids
    for token in ids:
        if checker.append(token):
            break
    return checker


def test_stops_on_eos_unless_ignored():
    done = feed(StopChecker(TOK, SamplingParams(max_new_tokens=50)), [104, 105, EOS, 106])
    assert done.finish_reason is FinishReason.STOP and done.matched_stop == EOS
    assert done.output_ids == [104, 105, EOS] and done.text == "hi"
    ignored = feed(StopChecker(TOK, SamplingParams(max_new_tokens=50, ignore_eos=True)), [104, EOS, 106])
    assert not ignored.finished and ignored.output_ids == [104, EOS, 106]


def test_stop_string_split_across_tokens_cuts_the_text():
    checker = feed(StopChecker(TOK, SamplingParams(stop=("###", "zz"), max_new_tokens=50)), "abc##")
    assert not checker.finished
    feed(checker, "#def")
    assert checker.finish_reason is FinishReason.STOP and checker.matched_stop == "###"
    assert checker.text == "abc"


def test_max_new_tokens_is_length():
    checker = feed(StopChecker(TOK, SamplingParams(max_new_tokens=3)), "abcdef")
    assert checker.finish_reason is FinishReason.LENGTH and checker.output_ids == TOK.encode("abc")
    with pytest.raises(RuntimeError):
        checker.append(100)
