"""Decode on a TPU: a ragged paged attention (one Pallas kernel per layer) that also stores the step's new K/V.

One query token per sequence, sequences of any context length in one batch, their pages anywhere in the pool. The
pool's rows are ``[K0, V0, K1, V1, ...]``, ``head_dim`` values each (``kernels.layout``): a layer is
``[pages, page_size, 2 * kv_heads * head_dim]``, tokens on the sublanes and heads on the lanes.

Why not JAX's ``ragged_paged_attention`` (``jax.experimental.pallas.ops.tpu``): it takes the pool as
``[pages, page_size, 2 * kv_heads, head_dim]``, heads on the sublanes. The bytes are ours, but on a TPU the last two
axes are tiled, so viewing our pool that way is a relayout, a copy of the whole layer on every call; and it takes
no ``2 * kv_heads`` that is not a multiple of the sublane packing (SmolLM2's 6 in bfloat16), nor writes the KV.

How it works:

- **The work is one list** of (row, block) items, every row's blocks of ``pages_per_block`` pages in turn, so a block
  is fetched ``BUFFERS - 1`` items ahead of the one computed, across rows too (a DMA's latency is microseconds). Only
  pages below a row's length are fetched: the cost follows the batch's context, never the pool or the table width.
  A block whose pages are one run of the pool is fetched in a few DMAs (its length in powers of two), others a DMA
  a page, in a loop. Which blocks are runs is worked out before the kernel, in XLA, for the whole batch.
- **Few lines of kernel**: the kernel is traced and lowered with every program that holds it, on every start (the
  compile cache keeps compiled programs, not traces), so its fetches are loops, not one ``pl.when`` per page: written
  out page by page, SmolLM2's 64-page blocks cost its decode programs seconds of tracing.
- **Every query head of a row is one matrix row** (``rows``: ``heads`` padded to the sublane tile). Per KV head the
  queries are zero outside that head's rows, so ``sum_h q_h . K_h`` puts each row's own head's scores in one
  ``[rows, tokens]`` block: the softmax runs once for all heads on full vector registers (a head of SmolLM2 has 3
  queries, of the 1.7B shape 2: per head, most of each register would be padding).
- **Where a head's K and V sit**: ``head_dim`` a multiple of 128, K and V are lane-aligned slices of the row; at
  ``head_dim`` 64 (SmolLM2) a head's K and V together fill one 128-lane group (the pool's K||V layout): the query is
  widened to 128 lanes with zeros where V sits, so ``q . group`` is ``q . K``, and the weighted sum of the groups
  holds the weighted V in its upper 64 lanes. Every slice stays lane-aligned.
- **Only blocks that hold context are computed**: a block is computed ``chunk_pages`` at a time, as many chunks as the
  row's context fills.
- **The new K/V is written here** (no separate write per layer): the row's last page is in VMEM anyway; the new row is
  merged into it there (so the token attends to itself), and its 16-row (8 in float32) tile is copied back to the
  pool, which the call aliases in place. A row's last page is its own (prefix pages are shared only when full).

The VMEM buffers are zeroed once per call, so a position past a row's context reads a finite value (its weight is 0,
and ``0 * x`` is NaN only for an infinite or NaN ``x``).

One row an item stays. Several rows a work item (R rows' chains side by side in one loop body, their blocks fetched
together) were built and measured on a v5e (2026-12-07, ``bench/decode_attention.py``, bfloat16, SmolLM2's shape at
16-token pages, batch 64 of 512-token rows, chunks of 1,024 / R positions): R = 2, 4 and 8 ran at 0.89, 0.83 and
0.69 times R = 1's speed (3.7, 4.0 and 4.8 ms for the 30 layers against 3.3), so they were removed.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

MASK_VALUE = -1e30
_LANES = 128
BUFFERS = 3  # blocks in VMEM: one computed while the next two are on their way
# Measured on a v5e (bench/decode_attention.py, docs/tpu.md): the kernel's time per chunk is mostly latency (a chain
# of dependent products and reductions), so few large chunks beat many small ones even where half of the last is
# past the context: at batch 64, SmolLM2's shape took 7.4 / 6.6 / 5.0 / 4.3 ms at 128 / 256 / 512 / 1,024 positions
# a chunk; blocks of 4 MiB beat 1 MiB by 3 to 7% (the 1.7B shape).
BLOCK_BYTES = 4 << 20  # KV bytes a block fetches at most (3 blocks in VMEM, of a v5e's 128 MiB)
MAX_PAGES_PER_BLOCK = 64
CHUNK_TOKENS = 1024  # positions computed at a time: a block's chunks past the row's context are skipped
_VMEM_LIMIT = 96 * 1024 * 1024  # of a v5e's 128 MiB: the buffers plus the batch's queries and outputs


def supported(head_dim: int) -> bool:
    return head_dim % _LANES == 0 or 2 * head_dim == _LANES


def default_pages_per_block(page_size: int, lanes: int, itemsize: int, block_bytes: int = BLOCK_BYTES) -> int:
    """Pages a block fetches: ``block_bytes`` of KV at most, a power of two, 1 to ``MAX_PAGES_PER_BLOCK``."""
    pages = max(1, min(MAX_PAGES_PER_BLOCK, block_bytes // (page_size * lanes * itemsize)))
    return 1 << (pages.bit_length() - 1)


def block_settings(page_size: int, lanes: int, itemsize: int, width: int, pages_per_block: int | None = None,
                   chunk_tokens: int | None = None) -> tuple[int, int]:
    """``(pages a row's block fetches, pages computed at a time)`` for a table ``width`` pages wide; ``None``: the
    defaults (``BLOCK_BYTES``, ``CHUNK_TOKENS``). A chunk is at least a page and divides the block."""
    per_block = min(width, pages_per_block or default_pages_per_block(page_size, lanes, itemsize))
    chunk_pages = max(1, min(per_block, (chunk_tokens or CHUNK_TOKENS) // page_size))
    while per_block % chunk_pages:
        chunk_pages -= 1
    return per_block, chunk_pages


def _sublanes(dtype) -> int:
    """Rows of one (sublane) tile: 8 for 32-bit values, 16 for bfloat16."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def block_copies(action, pool, into, sem, tables, row, first, used, one_run, run_index, pages_per_block: int):
    """``action`` (start or wait) on each DMA that brings pages ``first .. first + used - 1`` of ``row``'s table from
    ``pool`` to ``into(index)`` (``index``: a page, or a ``pl.ds`` of pages, of the block's buffer). Where those pages
    are one run of the pool (``one_run[run_index]``, decided before the kernel: a prompt's pages mostly are, the
    allocator hands them out in order), the run goes in one DMA per set bit of its length; otherwise a DMA a page, in a
    loop over the pages in use. Both are written once, not once per page: the kernel is traced and lowered with every
    program that holds it (a block of 64 pages written out page by page cost SmolLM2's decode programs seconds of
    tracing). ``used`` is 0 (no DMA) or more."""
    width = tables.shape[1]
    start_page = tables[row, jnp.minimum(first, width - 1)]

    @pl.when(one_run[run_index] != 0)
    def _runs():
        size = 1 << (pages_per_block.bit_length() - 1)
        while size:  # the run's length in binary: a piece of each set bit's size, after the larger ones
            offset = used // (2 * size) * (2 * size)
            copy = pltpu.make_async_copy(pool.at[pl.ds(start_page + offset, size)], into(pl.ds(offset, size)), sem)
            pl.when((used & size) != 0)(lambda copy=copy: action(copy))
            size //= 2

    @pl.when(one_run[run_index] == 0)
    def _pages():
        def page(j, carry):
            column = jnp.minimum(first + j, width - 1)
            action(pltpu.make_async_copy(pool.at[tables[row, column]], into(j), sem))
            return carry

        jax.lax.fori_loop(0, used, page, 0)


def _kernel(kv_lens, writes, tables, work_rows, work_blocks, one_run, num_blocks, total,  # scalar prefetch (SMEM)
            q_ref, new_ref, pool_in, o_ref, pool_out,  # inputs, outputs
            buf, sems, write_sem, m_ref, l_ref, acc_ref,  # scratch
            *, pages_per_block: int, chunk_pages: int, head_dim: int, pair: bool, group: int):
    _, page_size, lanes = pool_in.shape
    kv_heads = q_ref.shape[1]
    rows, q_lanes = q_ref.shape[2], q_ref.shape[3]
    chunk = chunk_pages * page_size
    tile = _sublanes(buf.dtype)
    # a float32 pool keeps float32 products (a TPU's default multiplies in one bfloat16 pass)
    precision = jax.lax.Precision.HIGHEST if buf.dtype == jnp.float32 else None
    dot = partial(jax.lax.dot_general, precision=precision, preferred_element_type=jnp.float32)

    def each(g, slot, action):
        """``action`` on each of item ``g``'s DMAs (``block_copies``)."""
        r, first = work_rows[g], work_blocks[g] * pages_per_block
        used = jnp.minimum(pages_per_block, (kv_lens[r] + page_size - 1) // page_size - first)
        block_copies(action, pool_in, lambda index: buf.at[slot, index], sems.at[slot], tables, r, first, used,
                     one_run, g, pages_per_block)

    start = lambda g: each(g, g % BUFFERS, lambda copy: copy.start())  # noqa: E731
    wait = lambda g: each(g, g % BUFFERS, lambda copy: copy.wait())  # noqa: E731

    count = total[0]
    buf[...] = jnp.zeros(buf.shape, buf.dtype)  # see the module's last paragraph
    o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)  # rows with no context (padding) stay zero
    # the first items' fetches, in a loop: each ``start`` written out is traced and lowered again
    jax.lax.fori_loop(0, jnp.minimum(count, BUFFERS - 1), lambda g, carry: (start(g), carry)[1], 0)
    row_ids = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    head_rows = [(row_ids >= h * group) & (row_ids < (h + 1) * group) for h in range(kv_heads)]

    def write_back(row, block, slot):
        """Merge ``row``'s new K/V into its last page (in VMEM) and copy that page's tile of rows to the pool."""
        position = kv_lens[row] - 1
        column = position // page_size
        j = column - block * pages_per_block
        base = pl.multiple_of((position % page_size) // tile * tile, tile)
        old = buf[slot, j, pl.ds(base, tile), :].astype(jnp.float32)
        at = jax.lax.broadcasted_iota(jnp.int32, (tile, lanes), 0) == position % page_size - base
        new = jnp.broadcast_to(new_ref[row].astype(jnp.float32), (tile, lanes))
        buf[slot, j, pl.ds(base, tile), :] = jnp.where(at, new, old).astype(buf.dtype)
        copy = pltpu.make_async_copy(buf.at[slot, j, pl.ds(base, tile)],
                                     pool_out.at[tables[row, column], pl.ds(base, tile)], write_sem)
        copy.start()

    def step(g, carry):
        pl.when(g + BUFFERS - 1 < count)(lambda: start(g + BUFFERS - 1))  # into the slot g - 1 has finished with
        row, block = work_rows[g], work_blocks[g]
        slot = g % BUFFERS
        last = block == num_blocks[row] - 1

        @pl.when(block == 0)
        def _new_row():
            m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
            l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        wait(g)
        writing = last & (writes[row] != 0)
        pl.when(writing)(lambda: write_back(row, block, slot))
        block_start = block * pages_per_block * page_size
        chunks = (jnp.minimum(kv_lens[row] - block_start, pages_per_block * page_size) + chunk - 1) // chunk

        def compute(c, carry):
            first_page = pl.multiple_of(c * chunk_pages, chunk_pages)
            position = block_start + c * chunk + jax.lax.broadcasted_iota(jnp.int32, (1, chunk), 1)
            visible = position < kv_lens[row]
            scores = None
            for h in range(kv_heads):
                lane = 2 * head_dim * h
                k = buf[slot, pl.ds(first_page, chunk_pages), :, pl.ds(lane, q_lanes)].reshape(chunk, q_lanes)
                part = dot(q_ref[row, h], k, (((1,), (1,)), ((), ())))  # [rows, chunk]
                scores = part if scores is None else scores + part
            scores = jnp.where(visible, scores, MASK_VALUE)
            m_prev = m_ref[...][:, :1]
            m_new = jnp.maximum(m_prev, scores.max(axis=1, keepdims=True))
            weights = jnp.exp(scores - m_new)
            scale = jnp.exp(m_prev - m_new)
            l_ref[...] = jnp.broadcast_to(scale * l_ref[...][:, :1] + weights.sum(axis=1, keepdims=True), l_ref.shape)
            m_ref[...] = jnp.broadcast_to(m_new, m_ref.shape)
            weights = weights.astype(buf.dtype)
            values = None
            for h in range(kv_heads):
                lane = 2 * head_dim * h + (0 if pair else head_dim)
                v = buf[slot, pl.ds(first_page, chunk_pages), :, pl.ds(lane, q_lanes)].reshape(chunk, q_lanes)
                part = jnp.where(head_rows[h], dot(weights, v, (((1,), (0,)), ((), ()))), 0.0)  # [rows, q_lanes]
                values = part if values is None else values + part
            acc_ref[...] = scale * acc_ref[...] + values
            return carry

        jax.lax.fori_loop(0, chunks, compute, 0)

        @pl.when(last)
        def _row_done():
            o_ref[row] = acc_ref[...] / l_ref[...][:, :1]

        @pl.when(writing)
        def _written():  # before the slot is fetched into again (the next step starts that)
            pltpu.make_async_copy(buf.at[slot, 0, pl.ds(0, tile)], pool_out.at[0, pl.ds(0, tile)], write_sem).wait()

        return carry

    jax.lax.fori_loop(0, count, step, 0)


def _work(kv_lens, tokens: int, slots: int):
    """The (row, block) items of the batch in order: each row's ``ceil(kv_len / tokens)`` blocks, row after row;
    ``slots`` bounds their count statically. Returns ``(rows, blocks, blocks_per_row, count[1])``."""
    b = kv_lens.shape[0]
    blocks = (kv_lens + tokens - 1) // tokens
    ends = jnp.cumsum(blocks)
    item = jnp.arange(slots, dtype=jnp.int32)
    # compare_all: one fused comparison; the default (a loop of log2(B) steps) costs a TPU microseconds a step
    rows = jnp.minimum(jnp.searchsorted(ends, item, side="right", method="compare_all"), b - 1).astype(jnp.int32)
    firsts = (item - (ends - blocks)[rows]).astype(jnp.int32)
    return rows, firsts, blocks.astype(jnp.int32), ends[-1:].astype(jnp.int32)


def consecutive_blocks(tables, kv_lens, rows, firsts, pages_per_block: int, page_size: int):
    """Per work item, 1 where the pages its block uses (those below its row's length) are consecutive in the pool,
    ``p, p + 1, ...``: the kernel fetches them in a few DMAs. Elementwise over the page tables, blocks as rows."""
    b, width = tables.shape
    blocks = -(-width // pages_per_block)
    grid = jnp.pad(tables, ((0, 0), (0, blocks * pages_per_block - width))).reshape(b, blocks, pages_per_block)
    column = jnp.arange(blocks * pages_per_block, dtype=jnp.int32).reshape(blocks, pages_per_block)
    in_use = column[None] < ((kv_lens + page_size - 1) // page_size)[:, None, None]
    j = jnp.arange(pages_per_block, dtype=jnp.int32)
    one_run = jnp.all(~in_use | (grid == grid[:, :, :1] + j), axis=2)  # [b, blocks]
    return one_run.reshape(-1)[rows * blocks + jnp.minimum(firsts, blocks - 1)].astype(jnp.int32)


def query_rows(q, kv_heads: int, q_lanes: int, dtype):
    """``q: [B, 1, H, D]`` as the kernel's ``[B, KVH, rows, q_lanes]``: for KV head ``h``, the rows of its query heads
    (``h * G`` to ``(h + 1) * G - 1``) hold their queries in lanes ``[0, D)``, scaled by ``D**-0.5``; all else 0."""
    b, _, heads, dim = q.shape
    group = heads // kv_heads
    rows = -(-heads // _sublanes(dtype)) * _sublanes(dtype)
    scaled = (q[:, 0].astype(jnp.float32) * dim**-0.5).astype(dtype)  # [B, H, D]
    padded = jnp.pad(scaled, ((0, 0), (0, rows - heads), (0, q_lanes - dim)))  # [B, rows, q_lanes]
    owner = jnp.arange(rows) // group  # the KV head of each row; padding rows' is kv_heads or more
    mine = owner[None, :] == jnp.arange(kv_heads)[:, None]  # [KVH, rows]
    return jnp.where(mine[None, :, :, None], padded[:, None], jnp.zeros((), dtype))


@partial(jax.jit, static_argnames=("pages_per_block", "chunk_tokens", "interpret"), donate_argnames=("layer_pool",))
def decode_step(q, k, v, layer_pool, page_tables, starts, lengths, *, pages_per_block: int | None = None,
                chunk_tokens: int | None = None, interpret: bool = False):
    """Store the new token's K/V (``k, v: [B, 1, KVH, D]``, at position ``starts[b]`` where ``lengths[b]`` is 1) in
    ``layer_pool: [N, page_size, 2 * KVH * D]`` through ``page_tables: [B, W]``, and attend ``q: [B, 1, H, D]`` over
    each row's positions ``[0, starts + lengths)``. Returns ``([B, 1, H, D], the pool written in place)``. Rows with
    no context (padding: ``starts + lengths`` 0) return zeros and write nothing. ``pages_per_block``,
    ``chunk_tokens``: a row's block and chunk (default ``block_settings``'s)."""
    b, _, heads, dim = q.shape
    _, page_size, lanes = layer_pool.shape
    kv_heads = lanes // (2 * dim)
    if not supported(dim):
        raise ValueError(f"decode_step takes head_dim 64 or a multiple of 128, got {dim}")
    if page_size % _sublanes(layer_pool.dtype):
        raise ValueError(f"decode_step takes pages of whole {_sublanes(layer_pool.dtype)}-row tiles, "
                         f"got {page_size} rows of {layer_pool.dtype}")
    pair = dim % _LANES != 0
    q_lanes = 2 * dim if pair else dim
    per_block, chunk_pages = block_settings(page_size, lanes, layer_pool.dtype.itemsize, page_tables.shape[1],
                                            pages_per_block, chunk_tokens)
    kv_lens = (starts + lengths).astype(jnp.int32)
    writes = (lengths > 0).astype(jnp.int32)
    tables = page_tables.astype(jnp.int32)
    settings = dict(pages_per_block=per_block, chunk_pages=chunk_pages, head_dim=dim, pair=pair,
                    group=heads // kv_heads)
    out, layer_pool = _attend(q, k, v, layer_pool, kv_lens, writes, tables, q_lanes, interpret, settings)
    values = out[:, :heads, q_lanes - dim:]  # [B, H, D]: V's lanes
    return values.reshape(b, 1, heads, dim).astype(q.dtype), layer_pool


def new_rows_of(k, v, dtype):
    """``k, v: [B, 1, KVH, D]`` as the pool's rows ``[B, 1, 2 * KVH * D]`` (``K0, V0, K1, V1, ...``)."""
    b, _, kv_heads, dim = k.shape
    return jnp.stack([k[:, 0], v[:, 0]], axis=2).reshape(b, 1, 2 * kv_heads * dim).astype(dtype)


def _attend(q, k, v, layer_pool, kv_lens, writes, tables, q_lanes, interpret, settings):
    b, _, heads, dim = q.shape
    _, page_size, lanes = layer_pool.shape
    kv_heads = lanes // (2 * dim)
    width = tables.shape[1]
    per_block = settings["pages_per_block"]
    rows, firsts, blocks, count = _work(kv_lens, per_block * page_size, b * -(-width // per_block))
    runs = consecutive_blocks(tables, kv_lens, rows, firsts, per_block, page_size)
    queries = query_rows(q, kv_heads, q_lanes, layer_pool.dtype)  # [B, KVH, R, q_lanes]
    r = queries.shape[2]
    new_rows = new_rows_of(k, v, layer_pool.dtype)
    whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))  # noqa: E731
    anywhere = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        partial(_kernel, **settings),
        out_shape=(jax.ShapeDtypeStruct((b, r, q_lanes), jnp.float32),
                   jax.ShapeDtypeStruct(layer_pool.shape, layer_pool.dtype)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=8,
            grid=(1,),
            in_specs=[whole(queries.shape), whole(new_rows.shape), anywhere],
            out_specs=[whole((b, r, q_lanes)), anywhere],
            scratch_shapes=[
                pltpu.VMEM((BUFFERS, per_block, page_size, lanes), layer_pool.dtype),
                pltpu.SemaphoreType.DMA((BUFFERS,)),
                pltpu.SemaphoreType.DMA(()),
                pltpu.VMEM((r, _LANES), jnp.float32),
                pltpu.VMEM((r, _LANES), jnp.float32),
                pltpu.VMEM((r, q_lanes), jnp.float32),
            ],
        ),
        input_output_aliases={10: 1},  # the pool: after the 8 scalar operands, the queries and the new rows
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",), vmem_limit_bytes=_VMEM_LIMIT),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(kv_lens, writes, tables, rows, firsts, runs, blocks, count, queries, new_rows, layer_pool)
