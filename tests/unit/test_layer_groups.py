"""A serving node runs a forward pass as a few programs in turn (``programs.LayeredForward``): the embedding, groups
of layers, the head. They must compute what the whole-model program (``decoder.forward_paged``) computes, over every
layer, in order, each layer's pool written once."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from side_by_side import forward_shapes, side_by_side

from fsm_pd.model import decoder
from fsm_pd.model.forward_shapes import layer_groups
from fsm_pd.model.params import random_params
from fsm_pd.model.programs import ForwardPrograms
from fsm_pd.model.tiny import tiny_config

# two computations of the model compared (logits, greedy tokens): float32 products at full precision on a TPU
# too (tests/on_chip.py)
pytestmark = [pytest.mark.chip, pytest.mark.usefixtures("full_precision")]  # chip: tests/on_tpu.sh

PAGE_SIZE = 16
PROMPT = [(7 * i + 3) % 250 for i in range(37)]


@pytest.mark.parametrize("layers, expected", [
    (30, [6] * 5),  # SmolLM2: one program for all five groups
    (2, [2]),  # the tiny model: one group
    (32, [8] * 4), (24, [6] * 4), (28, [7] * 4), (22, [11] * 2),
    (13, [4, 4, 5]), (26, [5, 5, 5, 5, 6]),  # no divisor near 6: near-equal groups of two sizes
])
def test_groups_cover_every_layer_once_in_order(layers, expected):
    groups = layer_groups(layers, 6)
    assert [count for _, count in groups] == expected
    assert [first for first, _ in groups] == list(np.cumsum([0, *expected[:-1]]))


def test_any_depth_is_covered_by_at_most_two_sizes():
    for layers in range(1, 129):
        for target in (1, 3, 6, 16):
            groups = layer_groups(layers, target)
            assert sum(count for _, count in groups) == layers
            assert all(first + count == nxt for (first, count), (nxt, _) in zip(groups, groups[1:], strict=False))
            assert len({count for _, count in groups}) <= 2


@pytest.fixture(scope="module")
def deep():
    """Thirteen layers: groups of 4, 4 and 5, so two group programs and three calls."""
    config = dataclasses.replace(tiny_config(), num_layers=13)
    return config, random_params(config, seed=2, std=0.1)


def pool_of(config, num_pages=32):
    shape = (num_pages, PAGE_SIZE, 2 * config.num_kv_heads * config.head_dim)
    return tuple(jnp.zeros(shape, jnp.float32) for _ in range(config.num_layers))


def run(config, params, forward, steps=4):
    """Prefill ``PROMPT`` then greedy-decode ``steps`` tokens; the logits of every step and the final pool."""
    pages = [1, 2, 3, 4, 5]
    out = decoder.prefill(config, params, pool_of(config), PROMPT, pages, forward=forward)
    pool, logits = out.pool, [np.asarray(out.logits)]
    for step in range(steps):
        token = int(np.argmax(logits[-1]))
        step_logits, pool = decoder.decode(config, params, pool, [token], [len(PROMPT) + step], [pages],
                                           forward=forward)
        logits.append(np.asarray(step_logits[0]))
    return logits, [np.asarray(layer) for layer in pool]


@pytest.mark.parametrize("layers_per_program", [6, 13], ids=["three-groups", "one-program"])
def test_the_groups_compute_what_the_whole_model_program_does(deep, layers_per_program):
    """Three group programs, or (as on a TPU) one program with the embedding and the head inside."""
    config, params = deep
    programs = ForwardPrograms(config, params, pool_of(config), layers_per_program=layers_per_program)
    assert [count for _, count in programs.groups] == ([4, 4, 5] if layers_per_program == 6 else [13])
    # the whole-model program and the groups' side by side: on the chip each is seconds of compile
    (whole_logits, whole_pool), (grouped_logits, grouped_pool) = side_by_side([
        lambda: run(config, params, forward=None),
        lambda: (forward_shapes(programs, [(1, 64), (1, 1)]), run(config, params, forward=programs))[1]])
    assert {(1, 1), (1, 64)} <= programs.shapes
    for whole, grouped in zip(whole_logits, grouped_logits, strict=True):
        np.testing.assert_allclose(grouped, whole, atol=2e-5, rtol=1e-5)
        assert np.argmax(grouped) == np.argmax(whole)
    # every layer's pool holds its own K/V (a layer skipped, run twice or given another's pool would differ)
    for layer, (whole, grouped) in enumerate(zip(whole_pool, grouped_pool, strict=True)):
        np.testing.assert_allclose(grouped, whole, atol=2e-5, rtol=1e-5, err_msg=f"layer {layer}")
        assert np.abs(grouped[1:6]).sum() > 0, f"layer {layer} wrote nothing"
