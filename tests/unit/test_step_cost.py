"""A forward pass costs what its batch reads, never the whole KV pool.

The bug this guards against: each layer's pool was written (the new tokens' K/V) and read (the context) in ways XLA
could not order, so the compiled step kept two versions of the donated pool and copied a whole layer every step.
Donation was still "accepted" (the old buffers were deleted), so only the program's own memory shows it. Here XLA's
memory analysis of the compiled step must not grow with the pool, every pool byte must be aliased to the output,
and a real call must consume the pool it was given without JAX's "donated buffers were not usable" warning.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding
from side_by_side import each_program, forward_shapes, side_by_side

from fsm_pd.kernels import pool_format
from fsm_pd.model import decoder
from fsm_pd.model.params import random_params
from fsm_pd.model.programs import ForwardPrograms
from fsm_pd.model.tiny import tiny_model_parts

# device programs: on a TPU host they run in the process that holds the chip (tests/on_tpu.sh)
pytestmark = pytest.mark.chip

PAGE_SIZE = 16


@pytest.fixture(scope="module", params=[2, 13], ids=["2-layers", "13-layers"])
def tiny(request):
    """The tiny model (one group of layers), and one as deep as 3 groups of two sizes
    (``forward_shapes.layer_groups``)."""
    config, params, _ = tiny_model_parts()
    if request.param != config.num_layers:
        config = dataclasses.replace(config, num_layers=request.param)
        params = random_params(config, seed=1, std=0.1)
    return config, params


def pool_of(config, num_pages):
    """A pool made as a serving node makes it: row-major, committed (``kernels/pool_format.py``)."""
    shape = (num_pages, PAGE_SIZE, 2 * config.num_kv_heads * config.head_dim)
    return pool_format.zeros(shape, jnp.float32, SingleDeviceSharding(jax.devices()[0]), config.num_layers)


def compiled_step(config, params, num_pages, batch, tokens):
    """The programs a serving node runs for this shape (``ForwardPrograms``), over a pool of ``num_pages``: compiled
    side by side, as a node's warm-up does (tests/side_by_side.py)."""
    pool = pool_of(config, num_pages)
    return pool, ForwardPrograms(config, params, pool).compile(batch, tokens, run=each_program)


@pytest.mark.parametrize("batch, tokens", [(1, 1), (8, 1), (2, 64)], ids=["decode-1", "decode-8", "prefill-2x64"])
def test_compiled_step_holds_nothing_the_size_of_the_pool(tiny, batch, tokens):
    config, params = tiny
    # the two pools' programs side by side: on the chip each 13-layer set is seconds of compile
    (small_pool, small), (big_pool, big) = side_by_side(
        [lambda pages=pages: compiled_step(config, params, pages, batch, tokens) for pages in (64, 4096)])
    small_temp, big_temp = small.memory_analysis().temp_size_in_bytes, big.memory_analysis().temp_size_in_bytes
    layer = big_pool[0].nbytes
    # 64x the pages: the step's scratch memory must not follow (a copied layer alone would add 16 MiB here). Only the
    # page table may move it by a few KB: it travels packed with the step's inputs and is unpacked in the program,
    # and its width follows the pool up to the model's longest context. It may shrink: on a TPU v5e XLA keeps up to
    # 1.1 MB less scratch at 4,096 pages than at 64 for a 13-layer decode step (bench/tpu_compile.py), nothing of
    # the pool's; only growth can be a copy of it.
    assert big_temp - small_temp < layer // 100, f"temporaries grew with the pool: {small_temp} -> {big_temp} B"
    assert big_temp < layer // 8
    # donation took: every layer of the pool is the output's buffer, not a copy of it (on the device, a row of 64
    # lanes takes 128 on a TPU: the bytes as stored)
    assert big.memory_analysis().alias_size_in_bytes == sum(a.on_device_size_in_bytes() for a in big_pool)


def test_a_step_consumes_its_pool_in_place(tiny):
    config, params = tiny
    # 4,096 pages, as the big pool above: its single-row decode step is that test's, loaded, not compiled again (on
    # a TPU XLA's default layout for these 64-lane rows is not row-major from 128 pages up, as at 512)
    pool = pool_of(config, 4096)
    pages = [[1, 2, 3, 4]]
    programs = ForwardPrograms(config, params, pool)
    forward_shapes(programs, [(1, 64), (1, 1)])  # the prefill's and the decode step's, side by side
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Some donated buffers were not usable" would be raised here
        result = decoder.prefill(config, params, pool, list(range(1, 40)), pages[0], forward=programs)
        assert all(layer.is_deleted() for layer in pool)
        before = result.pool
        logits, after = decoder.decode(config, params, before, [5], [39], pages, forward=programs)
    assert all(layer.is_deleted() for layer in before)
    # and it comes back as it went in, row-major (on a TPU, XLA's default for these 64-lane rows at 512 pages is not)
    assert all(layer.format.layout.major_to_minor == (0, 1, 2) for layer in after)
    assert np.isfinite(np.asarray(logits)).all() and after[0].shape == pool[0].shape
