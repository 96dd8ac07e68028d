"""Gather and scatter of pages as Pallas TPU DMA kernels, in the style of tpu-inference's ``multi_layer_copy``.

Each contiguous run of pages (``runs.PageRuns``) becomes one HBM->HBM DMA per layer. One kernel starts the DMAs of
every run of every layer before it waits on any, so the DMA engines see the whole transfer at once instead of one
layer at a time; each layer has its own DMA semaphore, which counts bytes, and a wait re-creates the same descriptor
so it waits for exactly that copy's bytes. The run table is scalar-prefetched into SMEM, so the page pattern is data,
not code: one compile per (bucket, pool shape). Scatter aliases each pool layer to the matching output
(``input_output_aliases``) and the jitted wrapper donates the pool, so untouched pages are never copied.

A sharded pool runs the same kernel under ``shard_map``: each device copies its own KV-head slice of each page.

Off TPU the kernels run in Pallas's TPU interpret mode (``pltpu.InterpretParams``), which simulates HBM, DMAs and
semaphores on the CPU; see ``docs/kernels.md`` for what that does and does not prove.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec

from fsm_pd.kernels.placement import Placement
from fsm_pd.kernels.pool_format import PoolJit
from fsm_pd.kernels.runs import PageRuns
from fsm_pd.kernels.validation import Pool

_NUM_RUN_SCALARS = 4  # num_runs, page_starts, row_starts, lengths: scalar-prefetched, in this order
_ANY = pl.BlockSpec(memory_space=pl.ANY)  # leave the array where it is (HBM); the kernel only hands refs to DMAs


def _start_all_then_wait_all(copy: Callable, num_layers: int, num_runs: jax.Array) -> None:
    """Start ``copy(layer, run)`` for every layer and run, then wait for each of them."""
    for layer in range(num_layers):

        @pl.loop(0, num_runs)
        def _start(run, layer=layer):
            copy(layer, run).start()

    for layer in range(num_layers):

        @pl.loop(0, num_runs)
        def _wait(run, layer=layer):
            copy(layer, run).wait()


def _gather_kernel(num_runs, page_starts, row_starts, lengths, *refs):
    *layers, staging, sems = refs  # L x [num_pages, ...] in HBM, [L, rows, ...] in HBM, DMA semaphores [L]

    def copy(layer, run):
        n = lengths[run]
        return pltpu.make_async_copy(
            layers[layer].at[pl.ds(page_starts[run], n)], staging.at[layer, pl.ds(row_starts[run], n)], sems.at[layer]
        )

    _start_all_then_wait_all(copy, len(layers), num_runs[0])


def _scatter_kernel(num_runs, page_starts, row_starts, lengths, staging, *refs):
    num_layers = (len(refs) - 1) // 2
    layers_out, sems = refs[num_layers : 2 * num_layers], refs[-1]  # the inputs alias these outputs; write through them

    def copy(layer, run):
        n = lengths[run]
        return pltpu.make_async_copy(
            staging.at[layer, pl.ds(row_starts[run], n)],
            layers_out[layer].at[pl.ds(page_starts[run], n)],
            sems.at[layer],
        )

    _start_all_then_wait_all(copy, num_layers, num_runs[0])


def _grid_spec(num_inputs: int, out_specs, num_layers: int) -> pltpu.PrefetchScalarGridSpec:
    return pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=_NUM_RUN_SCALARS,
        grid=(1,),  # one program: all the parallelism is in the DMA engines
        in_specs=[_ANY] * num_inputs,
        out_specs=out_specs,
        scratch_shapes=[pltpu.SemaphoreType.DMA((num_layers,))],
    )


def _interpret_params(interpret: bool):
    return pltpu.InterpretParams() if interpret else False


def _gather_call(*scalars_and_pool, rows: int, interpret: bool) -> jax.Array:
    pool = scalars_and_pool[_NUM_RUN_SCALARS:]
    first = pool[0]
    return pl.pallas_call(
        _gather_kernel,
        out_shape=jax.ShapeDtypeStruct((len(pool), rows, *first.shape[1:]), first.dtype),
        grid_spec=_grid_spec(len(pool), _ANY, len(pool)),
        interpret=_interpret_params(interpret),
    )(*scalars_and_pool)


def _scatter_call(*scalars_staging_pool, interpret: bool) -> Pool:
    pool = scalars_staging_pool[_NUM_RUN_SCALARS + 1 :]
    first_layer_operand = _NUM_RUN_SCALARS + 1  # operand indices count the scalar-prefetch arguments too
    return tuple(
        pl.pallas_call(
            _scatter_kernel,
            out_shape=tuple(jax.ShapeDtypeStruct(layer.shape, layer.dtype) for layer in pool),
            grid_spec=_grid_spec(1 + len(pool), [_ANY] * len(pool), len(pool)),
            input_output_aliases={first_layer_operand + i: i for i in range(len(pool))},
            interpret=_interpret_params(interpret),
        )(*scalars_staging_pool)
    )


def _run_scalars(runs: PageRuns) -> np.ndarray:
    """The run table as one host array (a TPU host pays about 0.1 ms a transfer: one, not four);
    ``_unpacked`` splits it on the device."""
    return np.concatenate([runs.num_runs, runs.page_starts, runs.row_starts, runs.lengths]).astype(np.int32)


def _unpacked(scalars: jax.Array) -> tuple[jax.Array, ...]:
    rows = (scalars.shape[0] - 1) // 3
    return scalars[:1], scalars[1:1 + rows], scalars[1 + rows:1 + 2 * rows], scalars[1 + 2 * rows:]


# Under shard_map, check_vma=False: pallas_call outputs carry no varying-mesh-axis annotation for the checker to use;
# every operand is per-device anyway (the scalars are replicated, the arrays split on the head axis).
@partial(jax.jit, static_argnames=("rows", "placement", "interpret"))
def _gather_jit(pool, scalars, *, rows, placement, interpret):
    scalars = _unpacked(scalars)
    call = partial(_gather_call, rows=rows, interpret=interpret)
    if placement is None:
        return call(*scalars, *pool)
    in_specs = (PartitionSpec(),) * _NUM_RUN_SCALARS + (placement.pool_spec,) * len(pool)
    sharded = jax.shard_map(
        call, mesh=placement.mesh, in_specs=in_specs, out_specs=placement.staging_spec, check_vma=False
    )
    return sharded(*scalars, *pool)


# the pool's results row-major, as it comes in (``pool_format.py``)
@partial(PoolJit, pool="pool", results=lambda pool: pool, static_argnames=("placement", "interpret"), donate_argnums=0)
def _scatter_jit(pool, staging, scalars, *, placement, interpret):
    scalars = _unpacked(scalars)
    call = partial(_scatter_call, interpret=interpret)
    if placement is None:
        return call(*scalars, staging, *pool)
    in_specs = (PartitionSpec(),) * _NUM_RUN_SCALARS + (placement.staging_spec,) + (placement.pool_spec,) * len(pool)
    out_specs = (placement.pool_spec,) * len(pool)
    sharded = jax.shard_map(call, mesh=placement.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    return sharded(*scalars, staging, *pool)


def gather_runs(pool: Pool, runs: PageRuns, rows: int, *, placement: Placement | None, interpret: bool) -> jax.Array:
    """Copy the runs' pages of every layer into a new ``[L, rows, page_size, 2HD]`` staging array.

    Rows past the last run are not written: their contents are unspecified.
    """
    return _gather_jit(pool, _run_scalars(runs), rows=rows, placement=placement, interpret=interpret)


def scatter_runs(
    pool: Pool, staging: jax.Array, runs: PageRuns, *, placement: Placement | None, interpret: bool
) -> Pool:
    """Copy the runs' staging rows into their pages of every layer. ``pool`` is donated: use only the result."""
    return _scatter_jit(pool, staging, _run_scalars(runs), placement=placement, interpret=interpret)
