"""Decode attention on a TPU: one query token per sequence, over only the pages its context fills (Pallas).

The pool's rows are ``[K0, V0, K1, V1, ...]``, ``head_dim`` values each (``kernels.layout``). The kernel walks
the batch's work as one list: every sequence's blocks of ``pages_per_block`` pages, sequence after sequence. It
copies each block into VMEM ``BUFFERS - 1`` items ahead of the one it computes, across sequences too (a DMA's
latency is microseconds: measured on the chip, a kernel that waited for each sequence's first block lost about
3 us a sequence), and keeps flash-attention's running max, sum and weighted values per KV head. Only pages below
the sequence's length are read, so the cost follows the batch's context, never the pool or the table width. A block
whose pages are one run of the pool (a prompt's pages mostly are: the allocator hands them out in order) is one DMA
instead of one a page.

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
_VMEM_LIMIT = 64 * 1024 * 1024  # of a TPU v5e's 128 MiB: the buffers, and the batch's queries and outputs


def supported(head_dim: int) -> bool:
    return head_dim % _LANES == 0 or 2 * head_dim == _LANES


def default_pages_per_block(page_size: int, lanes: int, itemsize: int) -> int:
    """About 1 MiB of KV per block (64 pages at most): measured on a TPU v5e, blocks of 64 pages ran 1.2 to 2.7 times
    faster than blocks of 4 to 16 (docs/tpu.md); larger ones no longer fit the buffers in VMEM."""
    pages = max(1, min(64, (1 << 20) // (page_size * lanes * itemsize)))
    return 1 << (pages.bit_length() - 1)


BUFFERS = 3  # blocks in VMEM: one computed while the next two are on their way (a DMA's latency is microseconds)


def _kernel(kv_lens, tables, work_rows, work_blocks, num_blocks, total, q_ref, pool_ref, o_ref, buf, sems, m_ref,
            l_ref, acc_ref, *, pages_per_block: int, head_dim: int, pair: bool):
    page_size, lanes = pool_ref.shape[1], pool_ref.shape[2]
    width = tables.shape[1]
    kv_heads = q_ref.shape[1]
    tokens = pages_per_block * page_size
    # a float32 pool keeps float32 products (a TPU's default multiplies in one bfloat16 pass)
    precision = jax.lax.Precision.HIGHEST if buf.dtype == jnp.float32 else None

    def block_copies(g, slot):
        """Work item ``g``'s copies: ``(whole, one copy of all its pages)`` where its pages are one run of the pool
        (as a prompt's pages mostly are: one DMA), and ``[(valid, copy of one page)]`` for the page-by-page way."""
        r, first = work_rows[g], work_blocks[g] * pages_per_block
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

    def start(g):
        whole, run, pages = block_copies(g, g % BUFFERS)
        pl.when(whole)(run.start)

        @pl.when(jnp.logical_not(whole))
        def _by_page():
            for valid, copy in pages:
                pl.when(valid)(copy.start)

    def wait(g):
        slot = g % BUFFERS
        whole, run, pages = block_copies(g, slot)
        pl.when(whole)(run.wait)

        @pl.when(jnp.logical_not(whole))
        def _by_page():
            for j, (valid, copy) in enumerate(pages):
                pl.when(valid)(copy.wait)

                @pl.when(jnp.logical_not(valid))
                def _zero(j=j):
                    buf[slot, j] = jnp.zeros((page_size, lanes), buf.dtype)

    count = total[0]
    o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)  # rows with no context (padding) stay zero
    for ahead in range(BUFFERS - 1):
        pl.when(ahead < count)(lambda ahead=ahead: start(ahead))

    def step(g, carry):
        pl.when(g + BUFFERS - 1 < count)(lambda: start(g + BUFFERS - 1))  # into the slot g - 1 has finished with
        row, block = work_rows[g], work_blocks[g]

        @pl.when(block == 0)
        def _new_row():
            m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
            l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        wait(g)
        kv = buf[g % BUFFERS].reshape(tokens, lanes)
        position = block * tokens + jax.lax.broadcasted_iota(jnp.int32, (1, tokens), 1)
        visible = position < kv_lens[row]
        for h in range(kv_heads):
            if pair:
                k = v = kv[:, 2 * head_dim * h: 2 * head_dim * (h + 1)]
            else:
                k = kv[:, 2 * head_dim * h: 2 * head_dim * h + head_dim]
                v = kv[:, 2 * head_dim * h + head_dim: 2 * head_dim * (h + 1)]
            q = q_ref[row, h]  # [G, width of k]
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

        @pl.when(block == num_blocks[row] - 1)
        def _row_done():
            o_ref[row] = acc_ref[...] / l_ref[...][:, :, :1]

        return carry

    jax.lax.fori_loop(0, count, step, 0)


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
    # the work, flattened: every (row, block) in order, so a block's pages are fetched while earlier ones compute,
    # across rows too
    blocks = (kv_lens + tokens - 1) // tokens
    ends = jnp.cumsum(blocks)
    slots = b * -(-page_tables.shape[1] // per_block)  # static bound on the work items
    item = jnp.arange(slots, dtype=jnp.int32)
    rows = jnp.minimum(jnp.searchsorted(ends, item, side="right"), b - 1).astype(jnp.int32)
    firsts = (item - (ends - blocks)[rows]).astype(jnp.int32)
    whole = pl.BlockSpec((b, kv_heads, padded_group, width), lambda *_: (0, 0, 0, 0))
    out = pl.pallas_call(
        partial(_kernel, pages_per_block=per_block, head_dim=dim, pair=pair),
        out_shape=jax.ShapeDtypeStruct((b, kv_heads, padded_group, width), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(1,),
            in_specs=[whole, pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=whole,
            scratch_shapes=[
                pltpu.VMEM((BUFFERS, per_block, page_size, lanes), layer_pool.dtype),
                pltpu.SemaphoreType.DMA((BUFFERS,)),
                pltpu.VMEM((kv_heads, padded_group, _LANES), jnp.float32),
                pltpu.VMEM((kv_heads, padded_group, _LANES), jnp.float32),
                pltpu.VMEM((kv_heads, padded_group, width), jnp.float32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",), vmem_limit_bytes=_VMEM_LIMIT),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(kv_lens.astype(jnp.int32), page_tables.astype(jnp.int32), rows, firsts, blocks.astype(jnp.int32),
      ends[-1:].astype(jnp.int32), grouped, layer_pool)
    values = out[:, :, :group, width - dim:]  # [B, KVH, G, D]: V's lanes
    return values.reshape(b, 1, heads, dim).astype(q.dtype)
