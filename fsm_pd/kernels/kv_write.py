"""A forward pass's new K/V written into the pool in place on a TPU: whole pages, one DMA each.

On a TPU, XLA's scatter of many rows into a donated pool passes over the whole pool (64 rows into a 30-layer bf16
pool: 0.33 ms at 64 pages, 11.4 ms at 2,185, 41.5 ms at 8,192; one row stays in place: ``docs/tpu.md``), and a
token's row is smaller than the chip's (16, 128) tile, so a kernel cannot copy one row on its own either. So the
write goes by whole pages: the pages a step writes are gathered (only those), the new rows are selected into them,
and a Pallas kernel copies each such page back into the pool it aliases, one DMA a page. The cost follows the
pages written, never the pool.

Rows that write nothing (padding rows, a row's page slots past its last token) point at the pad page, and the
kernel skips them: the pad page is never written, so it cannot race with itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from fsm_pd.kernels.layout import PAD_PAGE

_ANY = pl.BlockSpec(memory_space=pl.ANY)


def pages_spanned(seq_len: int, page_size: int) -> int:
    """The most pages ``seq_len`` consecutive positions can touch, wherever in a page they start."""
    return (seq_len + page_size - 2) // page_size + 1


def touched_pages(page_tables, starts, lengths, seq_len: int, page_size: int):
    """``[B, pages_spanned]``: the pages each row's new tokens land in, in order, ``PAD_PAGE`` past the last."""
    span = pages_spanned(seq_len, page_size)
    first = starts // page_size
    columns = first[:, None] + jnp.arange(span, dtype=jnp.int32)[None, :]  # [B, span]
    last = (starts + lengths - 1) // page_size
    used = (lengths[:, None] > 0) & (columns <= last[:, None])
    pages = jnp.take_along_axis(page_tables, jnp.clip(columns, 0, page_tables.shape[1] - 1), axis=1)
    return jnp.where(used, pages, PAD_PAGE)


def merged_pages(layer_pool, rows, pages, starts, lengths):
    """The touched ``pages`` ``[B, span]`` as they must read after the write: ``[B, span, page_size, lanes]``.

    ``rows: [B, S, lanes]`` are the new tokens' pool rows, row ``b``'s first at position ``starts[b]``."""
    page_size = layer_pool.shape[1]
    b, s, _ = rows.shape
    old = layer_pool[pages]  # only the touched pages
    span = pages.shape[1]
    position = ((starts // page_size)[:, None] + jnp.arange(span, dtype=jnp.int32)[None, :])[:, :, None] * page_size \
        + jnp.arange(page_size, dtype=jnp.int32)[None, None, :]  # [B, span, page_size]
    token = position - starts[:, None, None]
    new = (token >= 0) & (token < lengths[:, None, None])
    picked = jnp.take_along_axis(rows, jnp.clip(token, 0, s - 1).reshape(b, span * page_size, 1), axis=1)
    return jnp.where(new[..., None], picked.reshape(old.shape), old)


def _write_kernel(pages_ref, merged_ref, _pool_in, pool_ref, sem):
    def copy(i):
        return pltpu.make_async_copy(merged_ref.at[i], pool_ref.at[pages_ref[i]], sem)

    @pl.loop(0, merged_ref.shape[0])
    def _start(i):
        @pl.when(pages_ref[i] != PAD_PAGE)
        def _():
            copy(i).start()

    @pl.loop(0, merged_ref.shape[0])
    def _wait(i):
        @pl.when(pages_ref[i] != PAD_PAGE)
        def _():
            copy(i).wait()


def write_pages(layer_pool, merged, pages, *, interpret: bool = False):
    """Copy ``merged: [M, page_size, lanes]`` into pages ``pages: int32[M]`` of ``layer_pool``, in place (the pool
    is aliased to the result: donate it), skipping ``PAD_PAGE`` entries."""
    return pl.pallas_call(
        _write_kernel,
        out_shape=jax.ShapeDtypeStruct(layer_pool.shape, layer_pool.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(1,), in_specs=[_ANY, _ANY], out_specs=_ANY,
            scratch_shapes=[pltpu.SemaphoreType.DMA(())],
        ),
        input_output_aliases={2: 0},  # operand 2 (after the page ids and the merged pages) is the pool
        interpret=pltpu.InterpretParams() if interpret else False,
    )(pages, merged, layer_pool)


def write_rows(layer_pool, rows, page_tables, starts, lengths, *, interpret: bool = False):
    """Store ``rows: [B, S, lanes]`` (row ``b``'s first real token at position ``starts[b]``, ``lengths[b]`` real)
    into ``layer_pool: [N, page_size, lanes]`` through each row's ``page_tables``; returns the pool, written in
    place. What ``attention.write_kv`` does with XLA's scatter, by whole pages instead."""
    page_size = layer_pool.shape[1]
    pages = touched_pages(page_tables, starts, lengths, rows.shape[1], page_size)
    merged = merged_pages(layer_pool, rows.astype(layer_pool.dtype), pages, starts, lengths)
    return write_pages(layer_pool, merged.reshape(-1, *layer_pool.shape[1:]), pages.reshape(-1), interpret=interpret)
