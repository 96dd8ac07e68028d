"""The TPU decode kernel (``model.decode_attention.decode_step``) against the jnp path (``attention.paged_attention``
with ``kernels="jnp"``: XLA's scatter of the new K/V, then ``attend_pages``), one layer, on ragged batches.

On a TPU the kernel runs natively; elsewhere in Pallas's TPU interpret mode, which simulates VMEM and the DMAs, so a
wrong page, a missed wait or a stale buffer shows here too. One batch holds every case the kernel tells apart: a row
whose only position is its new token, rows spanning several blocks (small blocks here, so a few pages make many) and
several chunks, a block whose pages are one run of the pool (fetched in power-of-two pieces) and rows whose pages lie
scattered (a DMA a page), a new token that opens a page, one in the second tile of its page, and a padding row (no
context: zeros, nothing written), and a row inside its first page. The batch is laid out in pages, so it means the
same at 16, 64 and 128 tokens a page (the sizes a TPU pool is measured at, ``kernels/layout.py``'s ``PAGE_SIZES``),
with small blocks (every block boundary crossed) and with the blocks the chip sizes itself. The pool must come out as
the jnp path leaves it, but for page 0 (the reserved pad page, which the jnp path writes padding into and the kernel
must never touch). A second, wider batch of 11 rows adds what the first lacks: a row that attends without writing
(a context, length 0), padding rows in a run, and a row of 10 pages (5 small blocks) among them.
"""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsm_pd.model import attention, decode_attention

ON_TPU = jax.default_backend() == "tpu"
INTERPRET = not ON_TPU
SHAPES = {  # head_dim: (heads, kv_heads): SmolLM2's grouping (K||V share a 128-lane group), and the 1.7B shape's
    64: (9, 3),
    128: (4, 2),
}
PAGE_SIZE = 16
PAGE_SIZES = (16, 64, 128)  # a TPU pool's candidates (docs/tpu-rounds.md, "Page size")
PAGES_PER_BLOCK = 2  # small blocks: a row of 6 pages and some is 4 blocks
CHUNK_TOKENS = 16  # a page a chunk (a chunk is never less than a page): a block is 2 chunks
BLOCKS = {"small-blocks": (PAGES_PER_BLOCK, CHUNK_TOKENS), "chip-blocks": (None, decode_attention.CHUNK_TOKENS)}


def ragged_batch(rng, page_size: int, num_pages: int, width: int):
    """``(starts, lengths, tables)`` of the batch described above; pages drawn without repeats from ``1..``."""
    p = page_size
    # the new token's position (= context before it): alone; 6 pages and some (one run of the pool); the last row of
    # a page; padding; opening a page; the second 8-row tile of a page; inside the first page
    starts = [0, 6 * p + 4, 3 * p - 1, 0, 4 * p, p + 9, 5]
    lengths = [1, 1, 1, 0, 1, 1, 1]
    return page_tables(rng, starts, lengths, page_size, num_pages, width)


def wider_batch(rng, page_size: int, num_pages: int, width: int):
    """``(starts, lengths, tables)``: the first batch's rows, then a row that attends without writing (its context
    ``2p + 3``, length 0), two padding rows and a row of 10 pages; for 40 pages and tables 12 wide."""
    p = page_size
    starts = [0, 6 * p + 4, 3 * p - 1, 0, 4 * p, p + 9, 5, 2 * p + 3, 0, 0, 9 * p + 2]
    lengths = [1, 1, 1, 0, 1, 1, 1, 0, 0, 0, 1]
    return page_tables(rng, starts, lengths, page_size, num_pages, width)


BATCHES = {"seven-rows": (ragged_batch, 32, 8), "eleven-rows": (wider_batch, 40, 12)}  # batch, pages, width


def page_tables(rng, starts: list[int], lengths: list[int], page_size: int, num_pages: int, width: int):
    """``(starts, lengths, tables)``: each row's pages for its context, row 1's one run at the pool's end, the
    others' drawn without repeats from ``1..`` (page 0, the pad page, never)."""
    need = [-(-(start + length) // page_size) for start, length in zip(starts, lengths, strict=True)]
    run = list(range(num_pages - need[1], num_pages))  # row 1: one run of the pool, as the allocator mostly gives
    free = list(rng.permutation(np.arange(1, num_pages - need[1])))  # the others: scattered
    tables = np.zeros((len(starts), width), np.int32)
    for row, pages in enumerate(need):
        if row == 1:
            tables[row, :pages] = run
        else:
            tables[row, :pages], free = free[:pages], free[pages:]
    return np.asarray(starts, np.int32), np.asarray(lengths, np.int32), tables


def run_both(head_dim: int, dtype, page_size: int = PAGE_SIZE, seed: int = 0, blocks: str = "small-blocks",
             batch: str = "seven-rows"):
    heads, kv_heads = SHAPES[head_dim]
    rng = np.random.default_rng(seed)
    rows_of, num_pages, width = BATCHES[batch]
    starts, lengths, tables = rows_of(rng, page_size, num_pages, width)
    lanes = 2 * kv_heads * head_dim
    pool = jnp.asarray(rng.normal(size=(num_pages, page_size, lanes)), dtype)
    b = len(starts)
    q, k, v = (jnp.asarray(rng.normal(size=(b, 1, n, head_dim)), dtype) for n in (heads, kv_heads, kv_heads))
    args = (jnp.asarray(tables), jnp.asarray(starts), jnp.asarray(lengths))
    before = np.asarray(pool, np.float32)
    want, want_pool = attention.paged_attention(q, k, v, pool.copy(), *args, kernels="jnp")
    pages_per_block, chunk_tokens = BLOCKS[blocks]
    got, got_pool = decode_attention.decode_step(q, k, v, pool.copy(), *args,
                                                 pages_per_block=pages_per_block, chunk_tokens=chunk_tokens,
                                                 interpret=INTERPRET)
    context = starts + lengths > 0  # a row of length 0 after a context attends (and writes nothing)
    return (np.asarray(got, np.float32)[context], np.asarray(want, np.float32)[context],
            np.asarray(got_pool, np.float32), np.asarray(want_pool, np.float32), before,
            np.asarray(got, np.float32)[~context])


@pytest.mark.parametrize("blocks", sorted(BLOCKS))
@pytest.mark.parametrize("page_size", PAGE_SIZES, ids=lambda p: f"page-{p}")
@pytest.mark.parametrize("head_dim", sorted(SHAPES), ids=lambda d: f"head_dim-{d}")
def test_decode_step_equals_the_jnp_path_on_a_ragged_batch(head_dim, page_size, blocks):
    got, want, got_pool, want_pool, before, padding = run_both(head_dim, jnp.float32, page_size, blocks=blocks)
    tolerance = 2e-2 if ON_TPU else 1e-5  # the chip multiplies float32 in bfloat16 passes unless told otherwise
    np.testing.assert_allclose(got, want, atol=tolerance, rtol=tolerance)
    np.testing.assert_array_equal(got_pool[1:], want_pool[1:])  # the new rows, where the jnp path put them
    np.testing.assert_array_equal(got_pool[0], before[0])  # the pad page untouched
    assert not padding.any()  # a row with no context: zeros


def test_decode_step_in_bfloat16_writes_the_second_tile_of_a_page():
    """bfloat16 packs 16 rows a tile: with 32-token pages, a token at offset 17 lands in a page's second tile."""
    got, want, got_pool, want_pool, before, _ = run_both(64, jnp.bfloat16, page_size=32, seed=1)
    np.testing.assert_allclose(got, want, atol=3e-2, rtol=3e-2)  # bf16 products in the kernel, float32 in jnp
    np.testing.assert_array_equal(got_pool[1:], want_pool[1:])
    np.testing.assert_array_equal(got_pool[0], before[0])


@pytest.mark.parametrize("head_dim", sorted(SHAPES), ids=lambda d: f"head_dim-{d}")
def test_decode_step_equals_the_jnp_path_on_the_wider_batch(head_dim):
    """Small blocks (2 pages) and a page a chunk: the 10-page row is 5 blocks of 2 chunks."""
    got, want, got_pool, want_pool, before, padding = run_both(head_dim, jnp.float32, batch="eleven-rows")
    tolerance = 2e-2 if ON_TPU else 1e-5
    np.testing.assert_allclose(got, want, atol=tolerance, rtol=tolerance)
    np.testing.assert_array_equal(got_pool[1:], want_pool[1:])  # no row written but those of length 1
    np.testing.assert_array_equal(got_pool[0], before[0])
    assert not padding.any()


@pytest.mark.parametrize("head_dim", sorted(SHAPES), ids=lambda d: f"head_dim-{d}")
def test_decode_step_in_bfloat16_on_the_wider_batch(head_dim):
    """32-token pages, as the bfloat16 case above: 2-page blocks, a page (32 tokens) a chunk."""
    got, want, got_pool, want_pool, before, padding = run_both(head_dim, jnp.bfloat16, page_size=32, seed=1,
                                                               batch="eleven-rows")
    np.testing.assert_allclose(got, want, atol=3e-2, rtol=3e-2)
    np.testing.assert_array_equal(got_pool[1:], want_pool[1:])
    np.testing.assert_array_equal(got_pool[0], before[0])
    assert not padding.any()


def test_block_settings_default_to_the_bytes_and_chunk_tokens_within_the_table():
    """``block_settings``: ``default_pages_per_block``'s blocks and ``CHUNK_TOKENS`` positions a chunk unless told,
    a block no wider than the table, a chunk at least a page and a divisor of the block."""
    for page_size in PAGE_SIZES:
        for lanes in (384, 512, 4096):
            for itemsize in (2, 4):
                per_block = decode_attention.default_pages_per_block(page_size, lanes, itemsize)
                assert decode_attention.block_settings(page_size, lanes, itemsize, 4096) == (
                    per_block, max(1, min(per_block, decode_attention.CHUNK_TOKENS // page_size)))
    assert decode_attention.block_settings(16, 384, 2, 40) == (40, 40)  # SmolLM2: the table's 40 pages, not 64
    assert decode_attention.block_settings(16, 384, 2, 40, pages_per_block=2, chunk_tokens=16) == (2, 1)
    assert decode_attention.block_settings(32, 384, 2, 40, pages_per_block=2, chunk_tokens=16) == (2, 1)  # a page
    assert decode_attention.block_settings(16, 384, 2, 40, chunk_tokens=48) == (40, 2)  # 3 pages: not a divisor


def test_blocks_follow_the_bytes_and_stay_powers_of_two():
    assert decode_attention.default_pages_per_block(16, 384, 2) == 64  # SmolLM2's 12 KiB pages: capped at 64
    assert decode_attention.default_pages_per_block(16, 4096, 2) == 32  # 128 KiB pages: 4 MiB
    assert decode_attention.default_pages_per_block(128, 4096, 2) == 4
    assert decode_attention.default_pages_per_block(128, 384, 2, block_bytes=1 << 20) == 8  # 10.7 -> 8
    assert decode_attention.default_pages_per_block(64, 384, 2) == 64  # SmolLM2 at 64-token pages: 48 KiB each
    assert decode_attention.default_pages_per_block(128, 384, 2) == 32  # 96 KiB pages: 42.7 -> 32


@pytest.mark.parametrize("page_size", PAGE_SIZES, ids=lambda p: f"page-{p}")
def test_the_blocks_in_vmem_stay_within_the_limit_at_every_page_size(page_size):
    """A block holds at most ``BLOCK_BYTES`` of KV whatever the page size, so the ``BUFFERS`` blocks in VMEM fit
    the kernel's VMEM limit with room for the queries and the chunk's scores (a chunk is at most ``CHUNK_TOKENS``)."""
    for lanes in (384, 512, 4096):  # SmolLM2's rows, the tests' head_dim 128, the 1.7B shape's
        for itemsize in (2, 4):
            pages = decode_attention.default_pages_per_block(page_size, lanes, itemsize)
            block = pages * page_size * lanes * itemsize
            assert block <= decode_attention.BLOCK_BYTES, (lanes, itemsize, pages)
            assert decode_attention.BUFFERS * block <= decode_attention._VMEM_LIMIT // 2


def pool_on(platform: str):
    """A stand-in for a pool's first layer, as ``kernels_for`` reads it: only where its devices are."""
    return [SimpleNamespace(sharding=SimpleNamespace(device_set=[SimpleNamespace(platform=platform)]))]


def test_the_tpu_kernels_are_a_tpu_pools_default_where_they_can_run(monkeypatch):
    monkeypatch.delenv(attention.ATTENTION_ENV, raising=False)
    assert attention.kernels_for(pool_on("tpu"), 64) == attention.kernels_for(pool_on("tpu"), 128) == "tpu"
    assert attention.kernels_for(pool_on("tpu"), 96) == "jnp"  # a head_dim the kernel does not take
    assert attention.kernels_for(pool_on("cpu"), 64) == "jnp"
    monkeypatch.setenv(attention.ATTENTION_ENV, "")  # set but empty: the default
    assert attention.kernels_for(pool_on("tpu"), 64) == "tpu"
    monkeypatch.setenv(attention.ATTENTION_ENV, "jnp")  # asked for: jnp on a TPU too
    assert attention.kernels_for(pool_on("tpu"), 64) == "jnp"
    monkeypatch.setenv(attention.ATTENTION_ENV, "tpu")
    assert attention.kernels_for(pool_on("tpu"), 64) == attention.kernels_for(pool_on("tpu"), 128) == "tpu"
    assert attention.kernels_for(pool_on("tpu"), 96) == "jnp"
    assert attention.kernels_for(pool_on("cpu"), 64) == "jnp"  # asked for, but no chip: jnp
    monkeypatch.setenv(attention.ATTENTION_ENV, "interpret")
    assert attention.kernels_for(pool_on("cpu"), 64) == "interpret"
    assert attention.kernels_for(pool_on("cpu"), 16) == "jnp"  # the tiny model: the kernels cannot
    monkeypatch.setenv(attention.ATTENTION_ENV, "pallas")
    with pytest.raises(ValueError, match="FSM_PD_ATTENTION"):
        attention.kernels_for(pool_on("tpu"), 64)
