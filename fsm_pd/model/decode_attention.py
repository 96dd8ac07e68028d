"""Decode attention on a TPU: one query token per sequence, over only the pages its context fills (Pallas).

The pool's rows are ``[K0, V0, K1, V1, ...]``, ``head_dim`` values each (``kernels.layout``). The kernel runs one
grid step per sequence, copies that sequence's pages into VMEM a block of ``pages_per_block`` pages at a time (two
buffers: the next block, or the next sequence's first, is on its way while one is computed), and keeps
flash-attention's running max, sum and weighted values per KV head. Only pages below the sequence's length are
read, so the cost follows the batch's context, never the pool or the table width. A block whose pages are one run
of the pool (a prompt's pages mostly are: the allocator hands them out in order) is one DMA instead of one a page.

Where a head's K and V sit in the row:
- ``head_dim`` a multiple of 128: K and V are lane-aligned slices of the block, used as they are;
- ``head_dim`` 64 (SmolLM2): a head's K and V together fill one 128-lane group. The query is widened to 128 lanes
  with zeros where V sits, so ``q . group`` is ``q . K``; the weighted sum of the groups holds the weighted V in its
  upper 64 lanes, and only those are kept. Every slice stays lane-aligned, at twice the (idle) matrix-unit work.
Other head dims use the jnp path (``attention.attend_pages``); ``supported`` says which.

Masked positions of a block (past the context, or pages not copied because the context ends before them) are
zeroed in VMEM before use, so a stale or uninitialised buffer can never turn into NaN through ``0 * x``.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

MASK_VALUE = -1e30
_LANES = 128


def supported(head_dim: int) -> bool:
    return head_dim % _LANES == 0 or 2 * head_dim == _LANES


def default_pages_per_block(page_size: int, lanes: int, itemsize: int) -> int:
    """About 256 KiB of KV per block: big enough to hide a DMA's latency, small enough to double-buffer in VMEM."""
    pages = max(1, (256 * 1024) // (page_size * lanes * itemsize))
    return 1 << (pages.bit_length() - 1)


def _kernel(kv_lens, tables, block_base, q_ref, pool_ref, o_ref, buf, sems, m_ref, l_ref, acc_ref, *,
            pages_per_block: int, head_dim: int, pair: bool):
    row, rows = pl.program_id(0), pl.num_programs(0)
    num_blocks_of = lambda r: (kv_lens[r] + pages_per_block * page_size - 1) // (pages_per_block * page_size)
    page_size, lanes = pool_ref.shape[1], pool_ref.shape[2]
    width = tables.shape[1]
    kv_heads = q_ref.shape[1]
    tokens = pages_per_block * page_size
    # a float32 pool keeps float32 products (a TPU's default multiplies in one bfloat16 pass)
    precision = jax.lax.Precision.HIGHEST if buf.dtype == jnp.float32 else None

    def block_copies(r, block, slot):
        """The block's copies: ``(whole, one copy of all its pages)`` where its pages are one run of the pool (as a
        prompt's pages mostly are: one DMA), and ``[(valid, copy of one page)]`` for the page-by-page way."""
        first = block * pages_per_block
        column = lambda j: jnp.minimum(first + j, width - 1)  # noqa: E731
        start_page = tables[r, column(0)]
        whole = (first + pages_per_block) * page_size <= kv_lens[r] + page_size - 1  # every page of it in use
        for j in range(1, pages_per_block):
            whole = whole & (tables[r, column(j)] == start_page + j)
        run = pltpu.make_async_copy(pool_ref.at[pl.ds(start_page, pages_per_block)], buf.at[slot], sems.at[slot])
        pages = [((first + j) * page_size < kv_lens[r],
                  pltpu.make_async_copy(pool_ref.at[tables[r, column(j)]], buf.at[slot, j], sems.at[slot]))
                 for j in range(pages_per_block)]
        return whole, run, pages

    def start(r, block, slot):
        whole, run, pages = block_copies(r, block, slot)
        pl.when(whole)(run.start)

        @pl.when(jnp.logical_not(whole))
        def _by_page():
            for valid, copy in pages:
                pl.when(valid)(copy.start)

    def wait(r, block, slot):
        whole, run, pages = block_copies(r, block, slot)
        pl.when(whole)(run.wait)

        @pl.when(jnp.logical_not(whole))
        def _by_page():
            for j, (valid, copy) in enumerate(pages):
                pl.when(valid)(copy.wait)

                @pl.when(jnp.logical_not(valid))
                def _zero(j=j):
                    buf[slot, j] = jnp.zeros((page_size, lanes), buf.dtype)

    count = num_blocks_of(row)
    base = block_base[row]

    @pl.when((row == 0) & (count > 0))
    def _first():
        start(row, 0, 0)

    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def block_step(i, carry):
        slot = (base + i) % 2
        nxt = 1 - slot

        @pl.when(i + 1 < count)
        def _next_block():
            start(row, i + 1, nxt)

        @pl.when((i + 1 == count) & (row + 1 < rows))
        def _next_row():
            @pl.when(num_blocks_of(row + 1) > 0)
            def _():
                start(row + 1, 0, nxt)

        wait(row, i, slot)
        block = buf[slot].reshape(tokens, lanes)
        position = i * tokens + jax.lax.broadcasted_iota(jnp.int32, (1, tokens), 1)
        visible = position < kv_lens[row]
        for h in range(kv_heads):
            if pair:
                k = v = block[:, 2 * head_dim * h: 2 * head_dim * (h + 1)]
            else:
                k = block[:, 2 * head_dim * h: 2 * head_dim * h + head_dim]
                v = block[:, 2 * head_dim * h + head_dim: 2 * head_dim * (h + 1)]
            q = q_ref[0, h]  # [G, width of k]
            scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                         preferred_element_type=jnp.float32)
            scores = jnp.where(visible, scores, MASK_VALUE)
            m_prev = m_ref[h][:, :1]
            m_new = jnp.maximum(m_prev, scores.max(axis=1, keepdims=True))
            weights = jnp.exp(scores - m_new)
            scale = jnp.exp(m_prev - m_new)
            l_ref[h] = jnp.broadcast_to(scale * l_ref[h][:, :1] + weights.sum(axis=1, keepdims=True), l_ref.shape[1:])
            m_ref[h] = jnp.broadcast_to(m_new, m_ref.shape[1:])
            acc_ref[h] = scale * acc_ref[h] + jax.lax.dot_general(
                weights.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                preferred_element_type=jnp.float32)
        return carry

    jax.lax.fori_loop(0, count, block_step, 0)
    total = jnp.maximum(l_ref[...][:, :, :1], 1e-30)  # rows with no context (padding) keep zeros
    o_ref[0] = acc_ref[...] / total


def _sublanes(dtype) -> int:
    return 8 * (4 // jnp.dtype(dtype).itemsize)


@partial(jax.jit, static_argnames=("pages_per_block", "interpret"))
def decode_attention(q, layer_pool, page_tables, kv_lens, *, pages_per_block: int | None = None,
                     interpret: bool = False):
    """Attention of ``q: [B, 1, H, D]`` (each row's token at position ``kv_lens[b] - 1``, its own K/V already in the
    pool) over ``layer_pool: [N, page_size, 2 * KVH * D]`` through ``page_tables: [B, W]``; returns ``[B, 1, H, D]``.
    Rows with ``kv_lens`` 0 (padding) return zeros."""
    b, _, heads, dim = q.shape
    _, page_size, lanes = layer_pool.shape
    kv_heads = lanes // (2 * dim)
    group = heads // kv_heads
    if not supported(dim):
        raise ValueError(f"decode_attention takes head_dim 64 or a multiple of 128, got {dim}")
    pair = dim % _LANES != 0
    per_block = pages_per_block or default_pages_per_block(page_size, lanes, layer_pool.dtype.itemsize)
    padded_group = -(-group // _sublanes(layer_pool.dtype)) * _sublanes(layer_pool.dtype)
    grouped = (q[:, 0].reshape(b, kv_heads, group, dim).astype(jnp.float32) * dim**-0.5).astype(layer_pool.dtype)
    width = 2 * dim if pair else dim
    grouped = jnp.pad(grouped, ((0, 0), (0, 0), (0, padded_group - group), (0, width - dim)))
    tokens = per_block * page_size
    blocks = (kv_lens + tokens - 1) // tokens
    block_base = jnp.cumsum(blocks) - blocks  # each row's first block, counted over the batch: picks its buffer
    out = pl.pallas_call(
        partial(_kernel, pages_per_block=per_block, head_dim=dim, pair=pair),
        out_shape=jax.ShapeDtypeStruct((b, kv_heads, padded_group, width), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(b,),
            in_specs=[pl.BlockSpec((1, kv_heads, padded_group, width), lambda r, *_: (r, 0, 0, 0)),
                      pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((1, kv_heads, padded_group, width), lambda r, *_: (r, 0, 0, 0)),
            scratch_shapes=[
                pltpu.VMEM((2, per_block, page_size, lanes), layer_pool.dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((kv_heads, padded_group, _LANES), jnp.float32),
                pltpu.VMEM((kv_heads, padded_group, _LANES), jnp.float32),
                pltpu.VMEM((kv_heads, padded_group, width), jnp.float32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(kv_lens.astype(jnp.int32), page_tables.astype(jnp.int32), block_base.astype(jnp.int32), grouped, layer_pool)
    values = out[:, :, :group, width - dim:]  # [B, KVH, G, D]: V's lanes
    return values.reshape(b, 1, heads, dim).astype(q.dtype)
