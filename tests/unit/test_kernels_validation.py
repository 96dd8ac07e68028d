"""Bad page ids and mismatched staging are rejected in Python, with the offending ids named, before any donation."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from fsm_pd.kernels import KVLayout, gather_pages, scatter_pages
from fsm_pd.kernels.validation import check_page_ids

# device programs: on a TPU host they run in the process that holds the chip (tests/on_tpu.sh)
pytestmark = pytest.mark.chip

NUM_PAGES = 8


def make_pool(num_layers: int = 2, dtype=jnp.float32) -> tuple:
    return tuple(jnp.full((NUM_PAGES, 2, 32), layer, dtype) for layer in range(num_layers))


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([3, 0, 4], r"page ids \[0\] are out of range \[1, 8\) \(page 0 is the reserved padding page\)"),
        ([1, 8, 9], r"page ids \[8, 9\] are out of range \[1, 8\)$"),
        ([-1, 2], r"page ids \[-1\] are out of range"),
        ([2, 5, 2, 5, 3], r"page ids \[2, 5\] appear more than once"),
        ([], "page ids are empty"),
        ([1.0, 2], "page ids must be ints"),
        ([True, 2], "page ids must be ints"),
        (np.array([1.5, 2.0]), "page ids must be ints, got dtype float64"),
        (np.array([[1, 2]]), "must be a 1-D sequence"),
    ],
)
@pytest.mark.parametrize("impl", ["jnp", "pallas"])
def test_bad_page_ids_are_rejected_by_gather_and_scatter(ids, message, impl):
    pool = make_pool()
    with pytest.raises(ValueError, match=message):
        gather_pages(pool, ids, impl=impl)
    staging = jnp.zeros((2, 8, 2, 32), jnp.float32)
    with pytest.raises(ValueError, match=message):
        scatter_pages(pool, staging, ids, impl=impl)
    assert not any(layer.is_deleted() for layer in pool), "a rejected scatter must not consume the pool"


def test_long_lists_of_bad_ids_are_abbreviated():
    with pytest.raises(ValueError, match=r"\[100, 101, .*, 109\] and 5 more are out of range"):
        check_page_ids(list(range(100, 115)), NUM_PAGES)


def test_accepts_numpy_and_jax_id_arrays():
    assert check_page_ids(np.array([3, 1], np.int64), NUM_PAGES).tolist() == [3, 1]
    assert check_page_ids(jnp.array([7, 2]), NUM_PAGES).dtype == np.int32


@pytest.mark.parametrize(
    ("staging", "message"),
    [
        (jnp.zeros((2, 2, 2, 32)), "staging holds 2 pages but 3 page ids were given"),
        (jnp.zeros((1, 4, 2, 32)), r"staging shape \[1, 4, 2, 32\] does not match the pool: expected \[2, rows"),
        (jnp.zeros((2, 4, 2, 16)), "does not match the pool"),
        (jnp.zeros((4, 2, 32)), "does not match the pool"),
        (jnp.zeros((2, 4, 2, 32), jnp.bfloat16), "staging dtype bfloat16 does not match the pool dtype float32"),
    ],
)
@pytest.mark.parametrize("impl", ["jnp", "pallas"])
def test_mismatched_staging_is_rejected(staging, message, impl):
    pool = make_pool()
    with pytest.raises(ValueError, match=message):
        scatter_pages(pool, staging, [1, 2, 3], impl=impl)
    assert not any(layer.is_deleted() for layer in pool)


def test_pools_must_be_uniform_and_match_their_layout():
    pool = make_pool()
    with pytest.raises(ValueError, match="pool layer 1 is float32"):
        gather_pages((pool[0], pool[1][:4]), [1])
    with pytest.raises(ValueError, match="no layers"):
        gather_pages((), [1])
    with pytest.raises(ValueError, match="must be even"):
        gather_pages((jnp.zeros((4, 2, 3)),), [1])
    layout = KVLayout(num_layers=2, num_pages=NUM_PAGES, page_size=2, kv_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="does not match its layout"):
        gather_pages(pool, [1], layout=layout)
    good = KVLayout(num_layers=2, num_pages=NUM_PAGES, page_size=2, kv_heads=2, head_dim=8)
    assert gather_pages(pool, [1], layout=good).shape == good.staging_shape(1)
