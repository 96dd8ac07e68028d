"""Penalties, min-p and logit bias against a numpy reference of SGLang's definitions, and per-row determinism."""

from __future__ import annotations

import numpy as np
import pytest

from fsm_pd.model.sampling import SamplingParams, adjust_logits, penalty_inputs, sample

# device programs: on a TPU host they run in the process that holds the chip (tests/on_tpu.sh)
pytestmark = pytest.mark.chip

V = 64


def reference(logits: np.ndarray, history, p: SamplingParams) -> np.ndarray:
    out = logits.astype(np.float64).copy()
    for tid in set(history):
        out[tid] = out[tid] / p.repetition_penalty if out[tid] > 0 else out[tid] * p.repetition_penalty
    for tid in history:
        out[tid] -= p.frequency_penalty
    for tid in set(history):
        out[tid] -= p.presence_penalty
    for tid, bias in p.logit_bias:
        out[tid] += bias
    return out


CASES = [
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(repetition_penalty=0.5),
    SamplingParams(frequency_penalty=1.5),
    SamplingParams(frequency_penalty=-0.7),
    SamplingParams(presence_penalty=2.0),
    SamplingParams(logit_bias=((3, 5.0), (9, -100.0))),
    SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=-0.5, logit_bias=((1, 2.5),)),
]


@pytest.mark.parametrize("params", CASES)
def test_adjusted_logits_match_the_reference(params):
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, size=(4, V)).astype(np.float32)
    histories = [rng.integers(0, V, size=n).tolist() for n in (0, 1, 7, 30)]
    counts, bias = penalty_inputs([params] * 4, histories, 4, V)
    got = np.asarray(adjust_logits(logits, counts, np.full(4, params.frequency_penalty, np.float32),
                                   np.full(4, params.presence_penalty, np.float32),
                                   np.full(4, params.repetition_penalty, np.float32), bias))
    for b in range(4):
        np.testing.assert_allclose(got[b], reference(logits[b], histories[b], params), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("params", CASES)
def test_greedy_takes_the_argmax_of_the_adjusted_logits(params):
    rng = np.random.default_rng(1)
    greedy = SamplingParams(**{**{f: getattr(params, f) for f in params.__slots__}, "temperature": 0.0})
    for trial in range(20):
        logits = rng.normal(0, 1, size=(1, V)).astype(np.float32)
        history = rng.integers(0, V, size=12).tolist()
        history += [int(np.argmax(logits[0]))] * 3  # the raw winner was seen: a penalty has something to change
        want = int(np.argmax(reference(logits[0], history, greedy)))
        assert int(sample(logits, [greedy], [trial], [len(history)], histories=[history])[0]) == want


def test_a_repeated_token_loses_to_a_close_second_under_each_penalty():
    logits = np.zeros((1, V), np.float32)
    logits[0, 5], logits[0, 6] = 2.0, 1.9
    plain = SamplingParams(temperature=0.0)
    assert sample(logits, [plain], [0], [1], histories=[[5]])[0] == 5
    for change in ({"repetition_penalty": 1.1}, {"frequency_penalty": 0.2}, {"presence_penalty": 0.2},
                   {"logit_bias": ((6, 0.2),)}):
        p = SamplingParams(temperature=0.0, **change)
        assert sample(logits, [p], [0], [1], histories=[[5]])[0] == 6, change


def test_min_p_never_samples_below_its_share_of_the_top_token():
    logits = np.log(np.array([[0.5, 0.3, 0.1, 0.06, 0.04] + [1e-9] * (V - 5)], np.float32))
    p = SamplingParams(min_p=0.15)  # keeps tokens with probability >= 0.075: ids 0, 1, 2
    seen = {int(sample(logits, [p], [seed], [0])[0]) for seed in range(300)}
    assert seen == {0, 1, 2}
    assert {int(sample(logits, [SamplingParams()], [s], [0])[0]) for s in range(300)} > {0, 1, 2}


def test_a_rows_tokens_do_not_depend_on_its_neighbours():
    rng = np.random.default_rng(2)
    logits = rng.normal(0, 2, size=(3, V)).astype(np.float32)
    mine = SamplingParams(frequency_penalty=1.0, min_p=0.05, logit_bias=((2, 3.0),))
    history = [1, 1, 4]
    alone = sample(logits[:1], [mine], [7], [3], histories=[history])[0]
    others = [SamplingParams(), SamplingParams(repetition_penalty=2.0, temperature=0.3)]
    together = sample(logits, [mine, *others], [7, 8, 9], [3, 0, 5], histories=[history, [], [0, 0]])[0]
    assert alone == together


@pytest.mark.parametrize("bad", [{"frequency_penalty": 2.5}, {"presence_penalty": -3}, {"repetition_penalty": 0},
                                 {"repetition_penalty": 2.1}, {"min_p": 1.5}, {"logit_bias": ((1, 101.0),)},
                                 {"logit_bias": ((-1, 1.0),)}])
def test_out_of_range_values_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
