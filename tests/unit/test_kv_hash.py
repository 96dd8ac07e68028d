"""The device KV hash (``kernels/kv_hash.py``): what it is, and that it sees what a wrong handoff does to pages.

Runs on jax's default device (the chip on a TPU host, ``tests/on_tpu.sh``), in the pool's dtype there (bf16), so the
three catches are checked on the hash the chip computes: a flipped bit, two pages swapped, and a stale page (one
page's content replaced by another valid page's). A sum of the words, or of terms that do not depend on where a word
sits, passes the last two.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsm_pd.kernels import KVLayout
from fsm_pd.kernels.kv_checksum import algorithm_for, pool_checksums
from fsm_pd.kernels.kv_hash import ALGORITHM, _hash, device_checksums

# device programs: on a TPU host they run in the process that holds the chip (tests/on_tpu.sh)
pytestmark = pytest.mark.chip

LAYOUT = KVLayout(num_layers=3, num_pages=16, page_size=4, kv_heads=2, head_dim=8, dtype="bfloat16")
WHOLE = [(0, 0, LAYOUT.slots)]


@pytest.fixture(scope="module")
def pool():
    rng = np.random.default_rng(7)
    return tuple(jax.device_put(rng.standard_normal(LAYOUT.layer_shape).astype(jnp.bfloat16))
                 for _ in range(LAYOUT.num_layers))


def reference(layer: np.ndarray, pages: list[int], lanes: slice) -> int:
    """The docstring's definition, in NumPy: each element's bits keyed by its position, murmur3's finalizer, summed."""
    words = np.concatenate([layer[p][:, lanes].reshape(-1) for p in pages]).view(np.uint16).astype(np.uint64)
    x = words ^ ((np.arange(words.size, dtype=np.uint64) * 0x9E3779B1) & 0xFFFFFFFF)
    for shift, mul in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        x = ((x ^ (x >> shift)) * mul) & 0xFFFFFFFF
    x ^= x >> 16
    return int(x.sum() & 0xFFFFFFFF)


def flip_bit(layer: jax.Array, page: int, row: int, lane: int, bit: int) -> jax.Array:
    host = np.array(layer)
    host[page, row, lane:lane + 1].view(np.uint16)[0] ^= 1 << bit
    return jax.device_put(host, layer.sharding)


def test_values_are_the_documented_function_of_the_bytes_in_transfer_order(pool):
    pages = [9, 2, 3, 14, 5]  # 5 pages: a bucket of 8, three padding rows left out
    parts = [(0, 0, 1), (0, 1, 1)]
    got = device_checksums(pool, pages, parts, LAYOUT.head_dim)
    hosts = [np.asarray(layer) for layer in pool]
    want = [[reference(h, pages, LAYOUT.slot_lanes(first, count)) for h in hosts] for _, first, count in parts]
    assert got == want
    assert pool_checksums(pool, pages, parts, LAYOUT.head_dim, ALGORITHM) == want  # the dispatcher's


def test_a_flipped_bit_changes_exactly_its_layer(pool):
    pages = [4, 7, 11]
    before = device_checksums(pool, pages, WHOLE, LAYOUT.head_dim)
    for bit in (0, 7, 15):  # mantissa, exponent, sign of a bf16
        changed = (pool[0], flip_bit(pool[1], 7, 3, 5, bit), pool[2])
        after = device_checksums(changed, pages, WHOLE, LAYOUT.head_dim)
        assert after[0][1] != before[0][1] and (after[0][0], after[0][2]) == (before[0][0], before[0][2]), bit
    other = (pool[0], flip_bit(pool[1], 8, 0, 0, 3), pool[2])  # a page the handoff does not hold
    assert device_checksums(other, pages, WHOLE, LAYOUT.head_dim) == before


def test_two_swapped_pages_change_every_layer(pool):
    before = device_checksums(pool, [4, 7, 11], WHOLE, LAYOUT.head_dim)[0]
    after = device_checksums(pool, [4, 11, 7], WHOLE, LAYOUT.head_dim)[0]
    assert all(a != b for a, b in zip(before, after, strict=True))


def test_a_stale_page_changes_every_layer(pool):
    """Page 7's content replaced by page 12's (both valid KV): the bytes of the pool are another valid pool's."""
    before = device_checksums(pool, [4, 7, 11], WHOLE, LAYOUT.head_dim)[0]
    stale = tuple(jax.device_put(np.asarray(layer).copy(), layer.sharding) for layer in pool)
    stale = tuple(layer.at[7].set(layer[12]) for layer in stale)
    after = device_checksums(stale, [4, 7, 11], WHOLE, LAYOUT.head_dim)[0]
    assert all(a != b for a, b in zip(before, after, strict=True))
    # the same page read twice, or the stale page read in place of the right one
    assert device_checksums(pool, [4, 12, 11], WHOLE, LAYOUT.head_dim)[0] == after


def test_one_program_per_page_bucket(pool):
    device_checksums(pool, [1, 2, 3, 4, 5], WHOLE, LAYOUT.head_dim)
    compiled = _hash._cache_size()
    for pages in ([6, 1, 2, 3, 4, 5], [9, 8, 7, 6, 5, 4, 3], [1, 2, 3, 4, 5, 6, 7, 8]):  # 6, 7, 8 pages: bucket 8
        device_checksums(pool, pages, WHOLE, LAYOUT.head_dim)
    assert _hash._cache_size() == compiled
    device_checksums(pool, list(range(1, 10)), WHOLE, LAYOUT.head_dim)  # 9 pages: bucket 16
    assert _hash._cache_size() == compiled + 1


def test_which_algorithm_a_pool_uses():
    assert algorithm_for(True, {}) == "crc32c"
    assert algorithm_for(True, {"FSM_PD_KV_CHECKSUM_ALGORITHM": ALGORITHM}) == ALGORITHM
    assert algorithm_for(False, {}) == ALGORITHM  # an accelerator: the device hash, whatever is asked
    assert algorithm_for(False, {"FSM_PD_KV_CHECKSUM_ALGORITHM": "crc32c"}) == ALGORITHM
    with pytest.raises(ValueError, match="known algorithms"):
        algorithm_for(True, {"FSM_PD_KV_CHECKSUM_ALGORITHM": "md5"})
