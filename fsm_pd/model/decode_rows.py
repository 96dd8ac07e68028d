"""The decode kernel with several rows a work item (``decode_attention.decode_step``'s ``rows_per_item`` R > 1).

The batch is cut into groups of R consecutive rows (the last padded with rows of no context); a work item is a
group's block ``j``: the ``j``-th block of each of its rows, fetched together (each row's pages in use, the same
DMAs as one row an item: ``decode_attention.block_copies``) ``BUFFERS - 1`` items ahead, and computed as R softmax
chains side by side in one loop body with no branch between them, so that the compiler can interleave them: while
one row's chain waits on a product or a reduction, the others' work fills the units (``decode_attention``'s
docstring says why that is the point). A group has as many items as its longest row has blocks; its other rows sit
those out masked (their scores all ``MASK_VALUE``: the running max, sum and output stay as they are).

Each row of an item keeps its own running max, sum and output in VMEM (``[R, ...]``), the same across the group's
items; a row's new K/V is merged and written back in the item that holds its last page, as with one row an item.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from fsm_pd.model.decode_attention import (
    _LANES,
    _VMEM_LIMIT,
    BUFFERS,
    MASK_VALUE,
    _sublanes,
    _work,
    block_copies,
    consecutive_blocks,
    new_rows_of,
    query_rows,
)


def _kernel(kv_lens, writes, tables, work_groups, work_blocks, one_run, group_blocks, total,  # scalar prefetch
            q_ref, new_ref, pool_in, o_ref, pool_out,  # inputs, outputs
            buf, sems, write_sem, m_ref, l_ref, acc_ref, finite,  # scratch
            *, rows_per_item: int, pages_per_block: int, chunk_pages: int, head_dim: int, pair: bool, group: int):
    n = rows_per_item
    _, page_size, lanes = pool_in.shape
    kv_heads = q_ref.shape[1]
    q_rows, q_lanes = q_ref.shape[2], q_ref.shape[3]
    chunk = chunk_pages * page_size
    block_tokens = pages_per_block * page_size
    tile = _sublanes(buf.dtype)
    precision = jax.lax.Precision.HIGHEST if buf.dtype == jnp.float32 else None  # as decode_attention._kernel
    dot = partial(jax.lax.dot_general, precision=precision, preferred_element_type=jnp.float32)
    pages_of = lambda row: (kv_lens[row] + page_size - 1) // page_size  # noqa: E731 - a row's pages in use

    def each(g, action):
        """``action`` on item ``g``'s DMAs, its rows in a loop (one copy of the fetch in the trace, whatever R)."""
        slot, first = g % BUFFERS, work_blocks[g] * pages_per_block

        def row_copies(i, carry):
            row = work_groups[g] * n + i
            used = jnp.clip(pages_of(row) - first, 0, pages_per_block)  # 0: the row ends in an earlier block
            block_copies(action, pool_in, lambda index: buf.at[slot, i, index], sems.at[slot], tables, row, first,
                         used, one_run, g * n + i, pages_per_block)
            return carry

        jax.lax.fori_loop(0, n, row_copies, 0)

    start = lambda g: each(g, lambda copy: copy.start())  # noqa: E731
    wait = lambda g: each(g, lambda copy: copy.wait())  # noqa: E731

    count = total[0]
    o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)  # groups of padding rows have no items
    for region in range(BUFFERS * n):  # no page of a row's buffer is known finite yet (see ``make_finite``)
        finite[region] = 0
    jax.lax.fori_loop(0, jnp.minimum(count, BUFFERS - 1), lambda g, carry: (start(g), carry)[1], 0)
    row_ids = jax.lax.broadcasted_iota(jnp.int32, (q_rows, 1), 0)
    head_rows = [(row_ids >= h * group) & (row_ids < (h + 1) * group) for h in range(kv_heads)]

    def step(g, carry):
        pl.when(g + BUFFERS - 1 < count)(lambda: start(g + BUFFERS - 1))  # into the slot g - 1 has finished with
        block, slot = work_blocks[g], g % BUFFERS
        rows = [work_groups[g] * n + i for i in range(n)]
        lengths = [kv_lens[row] for row in rows]  # read once, used in every chunk
        first = block * pages_per_block
        block_start = first * page_size

        @pl.when(block == 0)
        def _new_rows():
            m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
            l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        wait(g)
        # the rows compute in step, as many chunks as the longest needs here
        chunks = 0
        for length in lengths:
            chunks = jnp.maximum(chunks, jnp.clip((length - block_start + chunk - 1) // chunk, 0,
                                                  pages_per_block // chunk_pages))

        def make_finite(i, carry):
            """A row's chunks read pages past those fetched for it here (it is shorter than another row, or its
            last chunk is partly past its context): those pages' weights are 0, but ``0 * x`` is NaN for a NaN
            ``x``, and VMEM starts as anything. Pages an earlier item fetched hold pool values; the rest are zeroed
            here, once a call for each row's buffer of each slot (``finite``: pages known finite): zeroing the
            whole buffers once a call, as one row an item does, is R times the stores."""
            region, need = slot * n + i, chunks * chunk_pages
            done = jnp.maximum(finite[region], jnp.clip(pages_of(rows[0] + i) - first, 0, pages_per_block))

            def zero(page, carry):
                buf[slot, i, page] = jnp.zeros((page_size, lanes), buf.dtype)
                return carry

            jax.lax.fori_loop(done, need, zero, 0)
            finite[region] = jnp.maximum(done, need)
            return carry

        jax.lax.fori_loop(0, n, make_finite, 0)

        def write_back(i, carry):
            """Merge row ``i``'s new K/V into its last page (in VMEM) if this item holds it, and copy that page's
            tile of rows to the pool (waited for at the end of the item)."""
            row = rows[0] + i
            position = kv_lens[row] - 1
            writing = (writes[row] != 0) & (position >= 0) & (position // block_tokens == block)

            @pl.when(writing)
            def _write():
                column = position // page_size
                j = column - first
                base = pl.multiple_of((position % page_size) // tile * tile, tile)
                old = buf[slot, i, j, pl.ds(base, tile), :].astype(jnp.float32)
                at = jax.lax.broadcasted_iota(jnp.int32, (tile, lanes), 0) == position % page_size - base
                new = jnp.broadcast_to(new_ref[row].astype(jnp.float32), (tile, lanes))
                buf[slot, i, j, pl.ds(base, tile), :] = jnp.where(at, new, old).astype(buf.dtype)
                pltpu.make_async_copy(buf.at[slot, i, j, pl.ds(base, tile)],
                                      pool_out.at[tables[row, column], pl.ds(base, tile)], write_sem).start()

            return carry + writing.astype(jnp.int32)

        written = jax.lax.fori_loop(0, n, write_back, 0)

        def compute(c, carry):
            """Chunk ``c`` of every row of the item: R independent chains in one body, no branch between them. Every
            row's running state is read before any is written, so no store orders one row's loads after another's."""
            first_page = pl.multiple_of(c * chunk_pages, chunk_pages)
            position = block_start + c * chunk + jax.lax.broadcasted_iota(jnp.int32, (1, chunk), 1)

            def kv(i, lane):  # row i's chunk: [chunk, q_lanes] from ``lane``
                return buf[slot, i, pl.ds(first_page, chunk_pages), :, pl.ds(lane, q_lanes)].reshape(chunk, q_lanes)

            state = [(m_ref[i][:, :1], l_ref[i][:, :1], acc_ref[i]) for i in range(n)]
            updated = []
            for i, (row, length) in enumerate(zip(rows, lengths, strict=True)):
                m_prev, l_prev, acc_prev = state[i]
                scores = None
                for h in range(kv_heads):
                    part = dot(q_ref[row, h], kv(i, 2 * head_dim * h), (((1,), (1,)), ((), ())))  # [q_rows, chunk]
                    scores = part if scores is None else scores + part
                scores = jnp.where(position < length, scores, MASK_VALUE)
                m_new = jnp.maximum(m_prev, scores.max(axis=1, keepdims=True))
                weights = jnp.exp(scores - m_new)
                scale = jnp.exp(m_prev - m_new)
                l_new = scale * l_prev + weights.sum(axis=1, keepdims=True)
                weights = weights.astype(buf.dtype)
                values = None
                for h in range(kv_heads):
                    v = kv(i, 2 * head_dim * h + (0 if pair else head_dim))
                    part = jnp.where(head_rows[h], dot(weights, v, (((1,), (0,)), ((), ()))), 0.0)  # [q_rows, q_lanes]
                    values = part if values is None else values + part
                updated.append((m_new, l_new, scale * acc_prev + values))
            for i, (m_new, l_new, acc_new) in enumerate(updated):
                m_ref[i] = jnp.broadcast_to(m_new, m_ref.shape[1:])
                l_ref[i] = jnp.broadcast_to(l_new, l_ref.shape[1:])
                acc_ref[i] = acc_new
            return carry

        jax.lax.fori_loop(0, chunks, compute, 0)

        @pl.when(block == group_blocks[work_groups[g]] - 1)
        def _group_done():
            for i, (row, length) in enumerate(zip(rows, lengths, strict=True)):
                # a padding row's chains ran on whatever its buffer held: its output is zeros all the same
                o_ref[row] = jnp.where(jnp.full((q_rows, 1), length) > 0, acc_ref[i] / l_ref[i][:, :1], 0.0)

        def written_wait(i, carry):  # before the slot is fetched into again (the next step starts that)
            pltpu.make_async_copy(buf.at[slot, 0, 0, pl.ds(0, tile)], pool_out.at[0, pl.ds(0, tile)],
                                  write_sem).wait()
            return carry

        jax.lax.fori_loop(0, written, written_wait, 0)
        return carry

    jax.lax.fori_loop(0, count, step, 0)


def attend(q, k, v, layer_pool, kv_lens, writes, tables, *, rows_per_item: int, q_lanes: int, interpret: bool,
           pages_per_block: int, **settings):
    """``decode_step``'s attention and KV write, R rows an item: ``(out [B, q_rows, q_lanes], the pool)``."""
    b, _, heads, dim = q.shape
    _, page_size, lanes = layer_pool.shape
    n = rows_per_item
    padded = -(-b // n) * n  # the last group's missing rows: no context, nothing written
    pad = lambda x: jnp.pad(x, [(0, padded - b)] + [(0, 0)] * (x.ndim - 1))  # noqa: E731
    kv_lens, writes, tables = pad(kv_lens), pad(writes), pad(tables)
    groups = padded // n
    items = groups * -(-tables.shape[1] // pages_per_block)
    work_groups, blocks, group_blocks, count = _work(kv_lens.reshape(groups, n).max(axis=1),
                                                     pages_per_block * page_size, items)
    members = work_groups[:, None] * n + jnp.arange(n, dtype=jnp.int32)  # [items, R]: each item's rows
    runs = consecutive_blocks(tables, kv_lens, members, jnp.broadcast_to(blocks[:, None], members.shape),
                              pages_per_block, page_size).reshape(-1)
    queries = pad(query_rows(q, lanes // (2 * dim), q_lanes, layer_pool.dtype))  # [B', KVH, q_rows, q_lanes]
    q_rows = queries.shape[2]
    new_rows = pad(new_rows_of(k, v, layer_pool.dtype))
    whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))  # noqa: E731
    anywhere = pl.BlockSpec(memory_space=pl.ANY)
    out, layer_pool = pl.pallas_call(
        partial(_kernel, rows_per_item=n, pages_per_block=pages_per_block, **settings),
        out_shape=(jax.ShapeDtypeStruct((padded, q_rows, q_lanes), jnp.float32),
                   jax.ShapeDtypeStruct(layer_pool.shape, layer_pool.dtype)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=8,
            grid=(1,),
            in_specs=[whole(queries.shape), whole(new_rows.shape), anywhere],
            out_specs=[whole((padded, q_rows, q_lanes)), anywhere],
            scratch_shapes=[
                pltpu.VMEM((BUFFERS, n, pages_per_block, page_size, lanes), layer_pool.dtype),
                pltpu.SemaphoreType.DMA((BUFFERS,)),
                pltpu.SemaphoreType.DMA(()),
                pltpu.VMEM((n, q_rows, _LANES), jnp.float32),
                pltpu.VMEM((n, q_rows, _LANES), jnp.float32),
                pltpu.VMEM((n, q_rows, q_lanes), jnp.float32),
                pltpu.SMEM((BUFFERS * n,), jnp.int32),
            ],
        ),
        input_output_aliases={10: 1},  # the pool: after the 8 scalar operands, the queries and the new rows
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",), vmem_limit_bytes=_VMEM_LIMIT),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(kv_lens, writes, tables, work_groups, blocks, runs, group_blocks, count, queries, new_rows, layer_pool)
    return out[:b], layer_pool
