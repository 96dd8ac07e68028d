"""The decode kernel with several rows a work item (``decode_step``'s ``rows_per_item``, ``model/decode_rows.py``)
against the jnp path, one layer, on a ragged batch; and R = 1 (one row an item) on the same batch.

On a TPU the kernel runs natively; elsewhere in Pallas's TPU interpret mode (VMEM starts as NaN there, so a page
computed but neither fetched nor zeroed shows). The batch holds what grouping rows can get wrong: 11 rows, a multiple
of neither 2 nor 8 (the last group padded); a row of length 1 and a row of 4 blocks in one group (the short one sits
the long one's blocks out, masked, and writes its KV in the group's first item, the long one in its last); a group
of padding rows alone at R = 2 (no items: zeros); a row of 5 blocks with scattered pages among padding rows at R = 8;
a row that attends without writing (length 0 after a context); new tokens at a page's last row, opening a page, in
the second tile of a bfloat16 page. Blocks are small (2 pages), so blocks and chunks turn over often; the chip's own
block sizes get a case too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_decode_attention import page_tables

from fsm_pd.model import attention, decode_attention

pytestmark = [pytest.mark.chip, pytest.mark.usefixtures("full_precision")]  # chip: tests/on_tpu.sh

ON_TPU = jax.default_backend() == "tpu"
SHAPES = {64: (9, 3), 128: (4, 2)}  # head_dim: (heads, kv_heads): SmolLM2's grouping, and a lane-aligned one
NUM_PAGES, WIDTH = 40, 12


def ragged_batch(rng, page_size: int):
    """``(starts, lengths, tables)``: the batch the module's docstring lists. Row 1's pages are one run of the pool,
    the others' drawn without repeats from the rest (page 0, the pad page, never)."""
    p = page_size
    starts = [0, 6 * p + 4, 3 * p - 1, 0, 4 * p, p + 9, 5, 2 * p + 3, 0, 0, 9 * p + 2]
    lengths = [1, 1, 1, 0, 1, 1, 1, 0, 0, 0, 1]
    return page_tables(rng, starts, lengths, page_size, NUM_PAGES, WIDTH)


def check(rows_per_item: int, head_dim: int, dtype, page_size: int, pages_per_block: int | None = 2,
          chunk_tokens: int | None = None, seed: int = 0):
    heads, kv_heads = SHAPES[head_dim]
    rng = np.random.default_rng(seed)
    starts, lengths, tables = ragged_batch(rng, page_size)
    pool = jnp.asarray(rng.normal(size=(NUM_PAGES, page_size, 2 * kv_heads * head_dim)), dtype)
    b = len(starts)
    q, k, v = (jnp.asarray(rng.normal(size=(b, 1, n, head_dim)), dtype) for n in (heads, kv_heads, kv_heads))
    args = (jnp.asarray(tables), jnp.asarray(starts), jnp.asarray(lengths))
    before = np.asarray(pool, np.float32)
    want, want_pool = attention.paged_attention(q, k, v, pool.copy(), *args, kernels="jnp")
    got, got_pool = decode_attention.decode_step(q, k, v, pool.copy(), *args, pages_per_block=pages_per_block,
                                                 chunk_tokens=chunk_tokens, rows_per_item=rows_per_item,
                                                 interpret=not ON_TPU)
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    got_pool, want_pool = np.asarray(got_pool, np.float32), np.asarray(want_pool, np.float32)
    context = starts + lengths > 0
    # bfloat16: its products in the kernel, float32's in jnp; float32 on a TPU: bfloat16 passes unless told otherwise
    tolerance = 3e-2 if dtype == jnp.bfloat16 else 2e-2 if ON_TPU else 1e-5
    np.testing.assert_allclose(got[context], want[context], atol=tolerance, rtol=tolerance)
    assert not got[~context].any()  # padding rows: zeros
    np.testing.assert_array_equal(got_pool[1:], want_pool[1:])  # every new row where the jnp path put it, no other
    np.testing.assert_array_equal(got_pool[0], before[0])  # the pad page untouched


@pytest.mark.parametrize("rows_per_item", [1, 2, 8], ids=lambda r: f"R{r}")
@pytest.mark.parametrize("head_dim", sorted(SHAPES), ids=lambda d: f"head_dim-{d}")
def test_rows_per_item_equals_the_jnp_path_in_float32(rows_per_item, head_dim):
    check(rows_per_item, head_dim, jnp.float32, page_size=16, chunk_tokens=16)  # a page a chunk: 2 a block


@pytest.mark.parametrize("rows_per_item", [1, 2, 8], ids=lambda r: f"R{r}")
@pytest.mark.parametrize("head_dim", sorted(SHAPES), ids=lambda d: f"head_dim-{d}")
def test_rows_per_item_equals_the_jnp_path_in_bfloat16(rows_per_item, head_dim):
    """32-token pages: bfloat16 packs 16 rows a tile, so row 2's new token (a page's last row) is in the second."""
    check(rows_per_item, head_dim, jnp.bfloat16, page_size=32, seed=1)  # a block a chunk


@pytest.mark.parametrize("rows_per_item", [2, 8], ids=lambda r: f"R{r}")
def test_rows_per_item_with_the_chips_own_blocks_and_chunks(rows_per_item):
    check(rows_per_item, 64, jnp.float32, page_size=16, pages_per_block=None)


def test_several_rows_an_item_share_the_vmem_one_row_an_item_had():
    """R rows an item fetch up to R blocks an item; their blocks shrink so that ``BUFFERS`` items of them stay within
    the VMEM limit with room to spare, and R = 1 keeps the blocks and chunks it always had."""
    for page_size in (16, 64, 128):
        for lanes in (384, 512, 4096):
            for itemsize in (2, 4):
                one = decode_attention.default_pages_per_block(page_size, lanes, itemsize)
                assert decode_attention.block_settings(page_size, lanes, itemsize, 4096) == (
                    one, max(1, min(one, decode_attention.CHUNK_TOKENS // page_size)))
                for rows in (2, 4, 8):
                    per_block, chunk_pages = decode_attention.block_settings(page_size, lanes, itemsize, 4096, rows)
                    item = rows * per_block * page_size * lanes * itemsize
                    assert decode_attention.BUFFERS * item <= decode_attention._VMEM_LIMIT // 2, (lanes, rows)
                    assert per_block % chunk_pages == 0
    # SmolLM2 at 16-token pages: a 64-page block a row still (768 KiB), 128 positions at a time at R = 8
    assert decode_attention.block_settings(16, 384, 2, 40, 8) == (40, 8)
    assert decode_attention.block_settings(16, 384, 2, 4096, 8) == (64, 8)
    with pytest.raises(ValueError, match="rows_per_item"):
        decode_attention.block_settings(16, 384, 2, 40, 0)


def test_a_batch_smaller_than_rows_per_item_takes_that_many_rows_an_item():
    """Two rows at R = 8: an item of 2 rows (6 padding rows would be computed for nothing), the jnp path's answer."""
    heads, kv_heads = SHAPES[64]
    rng = np.random.default_rng(2)
    pool = jnp.asarray(rng.normal(size=(8, 16, 2 * kv_heads * 64)), jnp.float32)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 1, n, 64)), jnp.float32) for n in (heads, kv_heads, kv_heads))
    args = (jnp.asarray([[3, 5, 0], [6, 0, 0]], jnp.int32), jnp.asarray([20, 4], jnp.int32),
            jnp.asarray([1, 1], jnp.int32))
    want, want_pool = attention.paged_attention(q, k, v, pool.copy(), *args, kernels="jnp")
    step = lambda rows: decode_attention.decode_step(q, k, v, pool.copy(), *args, rows_per_item=rows,  # noqa: E731
                                                     interpret=not ON_TPU)
    got, got_pool = step(8)
    tolerance = 2e-2 if ON_TPU else 1e-5
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=tolerance, rtol=tolerance)
    np.testing.assert_array_equal(np.asarray(got_pool)[1:], np.asarray(want_pool)[1:])
    traced = lambda rows: decode_attention.decode_step.trace(  # noqa: E731
        q, k, v, pool, *args, rows_per_item=rows, interpret=not ON_TPU).jaxpr
    assert str(traced(8)) == str(traced(2)) != str(traced(1))
