"""``SamplingParams`` refuses every value the batched sampler cannot take, and the sampler clips ``top_k`` to the
vocabulary, so no request's parameters can fail the batch it shares with others."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from fsm_pd.model.sampling import MAX_SEED, MAX_STOP_STRINGS, MAX_TOP_K, SamplingParams, sample

# device programs: on a TPU host they run in the process that holds the chip (tests/on_tpu.sh)
pytestmark = pytest.mark.chip


@pytest.mark.parametrize("fields", [
    {"temperature": math.nan}, {"temperature": math.inf}, {"temperature": -0.1},
    {"top_p": math.nan}, {"top_p": math.inf}, {"top_p": 0.0}, {"top_p": 1.01},
    {"top_k": -1}, {"top_k": MAX_TOP_K + 1}, {"top_k": 10**12}, {"top_k": 2.5}, {"top_k": True},
    {"max_new_tokens": 0}, {"max_new_tokens": 1.5},
    {"seed": -1}, {"seed": MAX_SEED + 1}, {"seed": "7"},
    {"stop": ("",)}, {"stop": ("x",) * (MAX_STOP_STRINGS + 1)},
    {"stop_token_ids": (-1,)}, {"stop_token_ids": (2**31,)},
])
def test_values_a_batch_cannot_take_are_refused(fields):
    with pytest.raises(ValueError):
        SamplingParams(**fields)


def test_the_largest_values_are_accepted():
    params = SamplingParams(top_k=MAX_TOP_K, seed=MAX_SEED, stop=("x",) * MAX_STOP_STRINGS,
                            stop_token_ids=(0, 2**31 - 1), temperature=1e30)
    assert params.top_k == MAX_TOP_K


def test_a_huge_top_k_samples_like_keeping_every_token_beside_ordinary_rows():
    vocab = 8
    logits = jnp.tile(jnp.linspace(0.0, 1.0, vocab, dtype=jnp.float32), (3, 1))
    rows = [SamplingParams(top_k=MAX_TOP_K), SamplingParams(top_k=0), SamplingParams(top_k=1)]
    got = sample(logits, rows, seeds=[3, 3, 3], steps=[0, 0, 0])
    assert got[0] == got[1]  # top_k beyond the vocabulary is "keep all", the same draw for the same seed
    assert got[2] == vocab - 1  # and its neighbour's top_k=1 still holds
    assert np.asarray(got).dtype == np.int32
