"""A forward pass costs what its batch reads, never the whole KV pool.

The bug this guards against: each layer's pool was written (the new tokens' K/V) and read (the context) in ways XLA
could not order, so the compiled step kept two versions of the donated pool and copied a whole layer every step.
Donation was still "accepted" (the old buffers were deleted), so only the program's own memory shows it. Here XLA's
memory analysis of the compiled step must not grow with the pool, every pool byte must be aliased to the output,
and a real call must consume the pool it was given without JAX's "donated buffers were not usable" warning.
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from fsm_pd.model import decoder
from fsm_pd.model.tiny import tiny_model_parts

PAGE_SIZE = 16


@pytest.fixture(scope="module")
def tiny():
    config, params, _ = tiny_model_parts()
    return config, params


def pool_of(config, num_pages):
    shape = (num_pages, PAGE_SIZE, 2 * config.num_kv_heads, config.head_dim)
    return tuple(jnp.zeros(shape, jnp.float32) for _ in range(config.num_layers))


def compiled_step(config, params, num_pages, batch, tokens):
    pool = pool_of(config, num_pages)
    width = decoder.table_width(config, num_pages, PAGE_SIZE)
    zeros = jnp.zeros((batch,), jnp.int32)
    return pool, decoder.forward_paged.lower(
        params, pool, jnp.zeros((batch, tokens), jnp.int32), zeros, zeros + 1, jnp.zeros((batch, width), jnp.int32),
        config=config,
    ).compile()


@pytest.mark.parametrize("batch, tokens", [(1, 1), (8, 1), (2, 64)], ids=["decode-1", "decode-8", "prefill-2x64"])
def test_compiled_step_holds_nothing_the_size_of_the_pool(tiny, batch, tokens):
    config, params = tiny
    small_pool, small = compiled_step(config, params, 64, batch, tokens)
    big_pool, big = compiled_step(config, params, 4096, batch, tokens)
    small_temp, big_temp = small.memory_analysis().temp_size_in_bytes, big.memory_analysis().temp_size_in_bytes
    layer = big_pool[0].nbytes
    # 64x the pages: the step's scratch memory must not follow (a copied layer alone would add 16 MiB here).
    assert big_temp == small_temp, f"temporaries grew with the pool: {small_temp} -> {big_temp} bytes"
    assert big_temp < layer // 8
    # donation took: every layer of the pool is the output's buffer, not a copy of it
    assert big.memory_analysis().alias_size_in_bytes == sum(a.nbytes for a in big_pool)


def test_a_step_consumes_its_pool_in_place(tiny):
    config, params = tiny
    pool = pool_of(config, 512)
    pages = [[1, 2, 3, 4]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Some donated buffers were not usable" would be raised here
        result = decoder.prefill(config, params, pool, list(range(1, 40)), pages[0])
        assert all(layer.is_deleted() for layer in pool)
        before = result.pool
        logits, after = decoder.decode(config, params, before, [5], [39], pages)
    assert all(layer.is_deleted() for layer in before)
    assert np.isfinite(np.asarray(logits)).all() and after[0].shape == pool[0].shape
