"""The sampling programs a warm-up prepares ahead (``warmup._sampler_thunks``: compiled from shapes, or on an
accelerator loaded as the executables an earlier start wrote) are what ``sampling.sample`` runs (``sampling.hold``):
a loaded program fills no jit cache, so calling the jitted functions would trace and lower them again on a request.
A held program that cannot take the arguments it gets runs jitted instead, and is let go."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsm_pd.model import sampling
from fsm_pd.model.sampling_params import SamplingParams
from fsm_pd.serving.warmup import _sampler_thunks

VOCAB, ROWS = 100, 4


@pytest.fixture
def held():
    """The four programs prepared at ROWS rows, each counting its calls; the module's table restored after."""
    saved = dict(sampling._held)
    sampling._held.clear()
    placed = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    calls: dict[str, int] = {}
    for prepare in _sampler_thunks(ROWS, VOCAB, placed).values():
        prepare()
    for (name, batch, where), program in list(sampling._held.items()):
        def counted(*args, program=program, name=name):
            calls[name] = calls.get(name, 0) + 1
            return program(*args)
        sampling.hold(name, batch, where, counted)
    yield calls, placed
    sampling._held.clear()
    sampling._held.update(saved)


def test_sample_runs_the_programs_the_warm_up_prepared_and_they_answer_as_jit_does(held):
    calls, placed = held
    logits = jax.device_put(np.random.RandomState(0).randn(ROWS, VOCAB).astype(np.float32), placed)
    params = [SamplingParams(temperature=0.7, top_p=0.9, frequency_penalty=0.5, logit_bias={3: 2.0})] * 3
    args = (logits, params, [1, 2, 3], [0, 1, 2])
    tokens = sampling.sample(*args, histories=[[1, 2], [3], []])
    greedy = sampling.sample(logits, [SamplingParams(temperature=0)] * ROWS, [0] * ROWS, [0] * ROWS)
    assert calls == {"adjust_logits": 1, "sample_tokens": 1, "greedy_tokens": 1}
    programs = dict(sampling._held)
    sampling._held.clear()  # the same requests on jit's own programs
    assert tokens.tolist() == sampling.sample(*args, histories=[[1, 2], [3], []]).tolist()
    assert greedy.tolist() == np.asarray(jnp.argmax(logits, axis=-1)).tolist()
    sampling._held.update(programs)


def test_a_held_program_that_cannot_take_the_arguments_runs_jitted_and_is_let_go(held):
    calls, placed = held
    logits = jax.device_put(np.random.RandomState(1).randn(ROWS, VOCAB).astype(jnp.bfloat16), placed)  # not float32
    greedy = sampling.sample(logits, [SamplingParams(temperature=0)] * ROWS, [0] * ROWS, [0] * ROWS)
    assert greedy.tolist() == np.asarray(jnp.argmax(logits, axis=-1)).tolist()
    assert calls == {"greedy_tokens": 1} and ("greedy_tokens", ROWS, placed) not in sampling._held
    assert ("sample_tokens", ROWS, placed) in sampling._held  # the others are kept


def test_logits_placed_elsewhere_run_on_programs_of_their_own_placement_and_leave_these_held(held):
    """``--role pd`` with a device for each role warms up samplers on each: logits of one device never run (or let
    go of) the programs held for another's. One CPU device here: the same device, placed by another kind of
    sharding, is another key."""
    calls, placed = held
    device = jax.devices()[0]
    elsewhere = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array([device]), ("x",)), jax.sharding.PartitionSpec())
    logits = jax.device_put(np.random.RandomState(2).randn(ROWS, VOCAB).astype(np.float32), elsewhere)
    greedy = sampling.sample(logits, [SamplingParams(temperature=0)] * ROWS, [0] * ROWS, [0] * ROWS)
    assert greedy.tolist() == np.asarray(jnp.argmax(logits, axis=-1)).tolist()
    assert calls == {} and ("greedy_tokens", ROWS, placed) in sampling._held
