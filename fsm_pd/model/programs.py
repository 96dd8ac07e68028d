"""The forward passes a serving node runs, compiled before it serves: one executable per (batch, tokens) shape.

``jax.jit`` compiles a program the first time a shape is called; on a serving node that is a request that waits
seconds, and late compiles grow the process (``docs/serving.md``). So a node compiles ahead, from the shapes its
configuration can form (``forward_shapes.py``), and calls the compiled executables directly.
``jax.stages.Compiled`` is not put back into ``jit``'s cache, which is why the model's wrappers take the
executor (``ForwardPrograms``) rather than relying on ``forward_paged``'s own cache.

A forward shape is not one program but a few, called in turn (``LayeredForward``): the embedding, one program per
group of ``LAYERS_PER_PROGRAM`` or so layers (every group of a size shares it, with each group's weights and pool
layers as arguments), and the head. XLA inlines whatever one program holds, so a whole-model program costs to compile
what its layers cost (SmolLM2, 30 layers: 1.3 to 1.8 s a shape on this project's 2-core machine); a group of 6 costs
0.6 s, the embedding and the head 0.05 s each, whatever the model's depth. A step then makes ``2 + layers / 6``
calls instead of one; at about 10 us a call that is lost in a 29 ms step (measured in ``docs/serving.md``, "Start-up":
a group of one layer, 30 calls, made the single-row decode step 19% dearer than the whole model in one program, the
default 3% dearer: one program per layer is too fine).

A node is ready before every shape is compiled (``serving/warmup.py``): a call whose shape is not compiled yet runs on
a compiled shape that *covers* it (``cover``): padded up to a larger one, or row by row on one of a single row. Rows
are independent (each writes only its own pages; padding rows and padding tokens write the pad page), so the answer
is the same, only dearer, until the background compile catches up; the covered shape is noted for it to compile
next (``compile_demand.py``). Only a call that nothing covers compiles on the
spot, and is counted (``compiles.py``): a bug in the ready set, not a failure.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from fsm_pd.kernels.pool_format import PoolJit, abstract_pool
from fsm_pd.model import compile_demand, executables
from fsm_pd.model.attention import kernels_for
from fsm_pd.model.config import ModelConfig
from fsm_pd.model.decoder import (
    LOGPROB_ROWS,
    embed_tokens,
    final_logits,
    forward_group,
    next_token_logprobs,
    table_width,
    top_params,
)
from fsm_pd.model.forward_shapes import call_cost, layer_groups
from fsm_pd.model.multi_step import StepPrograms
from fsm_pd.model.tensor_parallel import TensorParallel, group_sharded

# Layers per program, roughly (``forward_shapes.layer_groups``). At least the model's depth makes the whole forward
# pass one program, the embedding and the head inside (``OneProgram``): on a TPU v5e that took SmolLM2's step at batch
# 1 from 2.7 ms to 1.7 ms through the node's call, but its programs then cost a cold start 54 s to compile
# (docs/tpu.md).
LAYERS_PER_PROGRAM = int(os.environ.get("FSM_PD_LAYERS_PER_PROGRAM", "6"))

def embed_step(embed, packed, *, tokens: int):
    """A step's inputs, sent as one array ``packed: [B, tokens + 2 + W]`` (tokens, starts, lengths, page tables: on
    a TPU host each transfer costs about 0.1 ms), unpacked on the device, and the tokens' embeddings."""
    return (embed_tokens(embed, packed[:, :tokens]), packed[:, tokens], packed[:, tokens + 1],
            packed[:, tokens + 2:])


def whole_step(params, pool, packed, *, config: ModelConfig, kernels: str, tokens: int):
    """``forward_paged`` on a step's packed inputs (``embed_step``): the whole model as one program."""
    x, starts, lengths, page_tables = embed_step(params["embed"], packed, tokens=tokens)
    x, pool = forward_group(params["layers"], pool, x, starts, lengths, page_tables, config=config, kernels=kernels)
    logits, hidden = final_logits(top_params(params), x, lengths, config=config)
    return logits, pool, hidden


_embed = jax.jit(embed_step, static_argnames=("tokens",))
# the pool's results row-major, as it comes in (``kernels/pool_format.py``): else XLA copies it both ways
_whole = PoolJit(whole_step, pool="pool", results=lambda pool: (None, pool, None),
                 static_argnames=("config", "kernels", "tokens"), donate_argnames=("pool",))
_group = PoolJit(forward_group, pool="pools", results=lambda pools: (None, pools),
                 static_argnames=("config", "kernels"), donate_argnames=("pools",))
_head = jax.jit(final_logits, static_argnames=("config",))


def placement_key(sharding: jax.sharding.Sharding):
    """One key for equivalent placements: a program returns ``P(None, None, 'tp')`` for a pool placed as
    ``P(None, None, 'tp', None)``, and the two must not look like two pools (a second set of programs)."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = list(sharding.spec)
        while spec and spec[-1] is None:
            spec.pop()
        return (sharding.mesh, tuple(spec), sharding.memory_kind)
    return sharding


_SHARED: dict = {}
_SHARED_LOCK = threading.Lock()


def compile_settings() -> tuple:
    """What jax's global settings put into a program beside its arguments, as ``jit``'s cache keys it: the default
    matmul precision (on a TPU, float32 products in one bfloat16 pass, or at full precision). A serving node never
    changes it; the suite does, per test module (``tests/on_chip.py``), and a program compiled under one setting must
    not be handed out under another."""
    return (str(jax.config.jax_default_matmul_precision),)


def programs_for(config: ModelConfig, params: dict, pool: tuple, tp: TensorParallel | None = None) -> ForwardPrograms:
    """The ``ForwardPrograms`` of this model shape over pools like ``pool``, shared by every caller in the process
    (as ``jit``'s own cache is): the executables take the weights as arguments, so one compile serves every copy."""
    signature = lambda arrays: tuple((a.shape, str(a.dtype), placement_key(a.sharding))
                                     for a in jax.tree.leaves(arrays))
    key = (config, signature(pool), signature(params), tp, kernels_for(pool, config.head_dim), compile_settings())
    with _SHARED_LOCK:
        programs = _SHARED.get(key)
        if programs is None:
            programs = _SHARED[key] = ForwardPrograms(config, params, pool, tp)
        return programs


class ForwardPrograms:
    """``forward_paged`` compiled for one model and one pool (its shape, dtype and placement), by input shape, as
    ``LayeredForward`` programs; with ``tp``, the groups' tensor-parallel form (``tensor_parallel.group_sharded``)
    over ``tp``'s mesh.

    Called like ``forward_paged`` without ``config``. Thread-safe: a node compiles ahead on its start-up thread, and
    a late compile, should one happen, runs on the model thread.
    """

    def __init__(self, config: ModelConfig, params: dict, pool: tuple, tp: TensorParallel | None = None, *,
                 layers_per_program: int | None = None):
        self.config, self.tp = config, tp
        abstract = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
        self._params = jax.tree.map(abstract, params)  # shapes only: no model's weights are kept alive here
        self._pool = abstract_pool(pool)  # row-major, as every pool is made and every program returns it
        self.width = table_width(config, pool[0].shape[0], pool[0].shape[1])
        self.kernels = kernels_for(pool, config.head_dim) if tp is None else "jnp"
        if layers_per_program is None:
            layers_per_program = LAYERS_PER_PROGRAM
        self.groups = layer_groups(config.num_layers, layers_per_program)
        # where the host's token arrays go: the pool's device, or every device of the mesh
        self._inputs = pool[0].sharding if tp is None else tp.replicated
        self._programs: dict[tuple[int, int], LayeredForward] = {}
        self._logprobs: dict[int, jax.stages.Compiled] = {}  # by top_k
        # several decode steps a dispatch (``multi_step.py``), on one device: a split model decodes a step at a time
        self.steps = (StepPrograms(config, self._params, self._pool, self.width, self.kernels, self._inputs)
                      if tp is None else None)
        self._lock = threading.Lock()
        # Run a missing shape on one that covers it, rather than compile it now: only where something compiles the
        # missing shapes meanwhile (a serving node's background compile, ``warmup.py``). Elsewhere (no warm-up) a new
        # shape compiles once and is used from then on: covering it forever would cost a batch of 32 decode steps
        # 32 calls each.
        self.covers = False

    @property
    def shapes(self) -> set[tuple[int, int]]:
        return set(self._programs)

    def compile(self, batch: int, tokens: int, *, run: Callable[[dict], dict] | None = None) -> LayeredForward:
        """The programs for ``[batch, tokens]`` inputs, compiled now if they were not yet, from shapes alone.
        ``run({name: thunk}) -> {name: result}`` compiles the shape's programs (each group size, the head, the
        embedding): one after the other by default; a node's warm-up runs them side by side on its threads."""
        with self._lock:
            program = self._programs.get((batch, tokens))
        if program is not None:
            return program
        run = run or (lambda thunks: {name: thunk() for name, thunk in thunks.items()})
        ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self._inputs)
        hidden = jax.ShapeDtypeStruct((batch, tokens, self.config.hidden_size), self._params["embed"].dtype,
                                      sharding=self._inputs)
        rows = (ints(batch), ints(batch), ints(batch, self.width))  # starts, lengths, page tables
        packed = ints(batch, tokens + 2 + self.width)
        if len(self.groups) == 1 and self.tp is None:
            whole = run({"whole": lambda: executables.compiled(_whole, self._params, self._pool, packed,
                                                               config=self.config, kernels=self.kernels,
                                                               tokens=tokens)})["whole"]
            with self._lock:
                return self._programs.setdefault((batch, tokens), OneProgram(whole, self._inputs))

        def group(first: int, count: int) -> jax.stages.Compiled:
            layers, pools = self._params["layers"][first:first + count], self._pool[first:first + count]
            if self.tp is None:
                return executables.compiled(_group, layers, pools, hidden, *rows, config=self.config,
                                            kernels=self.kernels)
            return executables.compiled(group_sharded, layers, pools, hidden, *rows, tp=self.tp)

        sizes = {count: first for first, count in reversed(self.groups)}  # each size once, at its first group
        compiled = run({  # the groups first: they take the longest
            **{("group", count): (lambda first=first, count=count: group(first, count))
               for count, first in sizes.items()},
            "head": lambda: executables.compiled(_head, top_params(self._params), hidden, ints(batch),
                                                 config=self.config),
            "embed": lambda: executables.compiled(_embed, self._params["embed"], packed, tokens=tokens),
        })
        program = LayeredForward(
            embed=compiled["embed"],
            groups=tuple((first, count, compiled[("group", count)]) for first, count in self.groups),
            head=compiled["head"],
            inputs=self._inputs,
        )
        with self._lock:
            return self._programs.setdefault((batch, tokens), program)

    def logits_sharding(self) -> jax.sharding.Sharding:
        """Where a forward pass leaves its logits, which the samplers are compiled for: known from the head at one
        row, compiled now (a shape's own compile then finds it in jit's cache), or from the single-row decode
        program where the model is one program."""
        if len(self.groups) == 1 and self.tp is None:
            return self.compile(1, 1).logits_sharding
        hidden = jax.ShapeDtypeStruct((1, 1, self.config.hidden_size), self._params["embed"].dtype,
                                      sharding=self._inputs)
        lengths = jax.ShapeDtypeStruct((1,), jnp.int32, sharding=self._inputs)
        return executables.compiled(_head, top_params(self._params), hidden, lengths,
                                    config=self.config).output_shardings[0]

    def compile_logprobs(self, top_k: int) -> None:
        """Compile ``decoder.next_token_logprobs`` for ``top_k`` ahead (prompt logprobs: one shape per ``top_k``)."""
        if top_k in self._logprobs:
            return
        hidden = jax.ShapeDtypeStruct((LOGPROB_ROWS, self.config.hidden_size), jnp.float32)
        program = executables.compiled(next_token_logprobs, self._params, hidden,
                                       jax.ShapeDtypeStruct((LOGPROB_ROWS,), jnp.int32), config=self.config,
                                       top_k=top_k)
        with self._lock:
            self._logprobs.setdefault(top_k, program)

    def next_token_logprobs(self, params, hidden, next_ids, *, top_k: int):
        """``decoder.next_token_logprobs`` on the program ``compile_logprobs`` made, or jitted where there is none."""
        program = self._logprobs.get(top_k)
        if program is None:
            return next_token_logprobs(params, hidden, next_ids, config=self.config, top_k=top_k)
        return program(params, hidden, next_ids)

    def cover(self, batch: int, tokens: int) -> tuple[int, int] | None:
        """The compiled shape that runs a ``[batch, tokens]`` call soonest, or None when none can: of those long
        enough, the one whose calls (``batch`` rows padded up, or split into calls of its rows) cost least, a call
        costing its padded tokens and ``CALL_TOKENS`` more (``forward_shapes.call_cost``); ties go to fewer padded
        tokens."""
        with self._lock:
            long_enough = [shape for shape in self._programs if shape[1] >= tokens]
        return min(long_enough, key=lambda shape: (call_cost(batch, shape), shape[0] * shape[1], shape[1]),
                   default=None)

    def __call__(self, params, pool, tokens, starts, lengths, page_tables):
        program = self._programs.get(tokens.shape)
        if program is not None:
            return program(params, pool, tokens, starts, lengths, page_tables)
        shape = self.cover(*tokens.shape) if self.covers else None
        if shape is None:  # nothing prepared covers it: compile now (counted as a serving compile)
            return self.compile(*tokens.shape)(params, pool, tokens, starts, lengths, page_tables)
        batch, length = tokens.shape
        kind = "decode" if length == 1 else "prefill"
        compile_demand.want((self, batch, length), kind, f"{kind} {batch}x{length}",
                            lambda: self.compile(batch, length))
        return self._run_covered(shape, params, pool, np.asarray(tokens), np.asarray(starts), np.asarray(lengths),
                                 np.asarray(page_tables))

    def _run_covered(self, shape, params, pool, tokens, starts, lengths, page_tables):
        """Run ``tokens: [B, S]`` on the compiled ``shape``: rows padded up (length 0: they write the pad page) and
        split into calls of ``shape[0]`` rows; the results joined on the host, as if one call of ``[B, S]`` ran.

        A call of padding rows alone is not run: with nothing to attend to, its attention divides 0 by 0, and the
        NaN it would store in the pad page poisons every later row that reads padding (0 x NaN is NaN)."""
        rows, width = shape
        program = self._programs[shape]
        b, s = tokens.shape
        logits, hidden, sharding = [], [], None
        for at in range(0, b, rows):
            n = min(rows, b - at)
            if not lengths[at:at + n].any():
                logits.append(None)
                hidden.append(np.zeros((n, s, self.config.hidden_size), np.float32))
                continue
            part = [a[at:at + n] for a in (tokens, starts, lengths, page_tables)]
            out_logits, pool, out_hidden = program(params, pool, _pad_rows(part[0], rows, width),
                                                   *(_pad_rows(a, rows) for a in part[1:]))
            sharding = out_logits.sharding
            logits.append(np.asarray(out_logits)[:n])
            hidden.append(np.asarray(out_hidden)[:n, :s])
        vocab = next(x for x in logits if x is not None).shape[-1]
        joined = np.concatenate([x if x is not None else np.zeros((min(rows, b - i * rows), vocab), np.float32)
                                 for i, x in enumerate(logits)])
        # placed as the program leaves its logits: the samplers are compiled for that placement
        return jax.device_put(joined, sharding), pool, np.concatenate(hidden)


@dataclass(frozen=True)
class LayeredForward:
    """One forward shape's programs, called like ``decoder.forward_paged`` without ``config``: the embedding, each
    group of layers in turn (``groups``: first layer, how many, program), the head."""

    embed: jax.stages.Compiled
    groups: tuple[tuple[int, int, jax.stages.Compiled], ...]
    head: jax.stages.Compiled
    inputs: jax.sharding.Sharding  # where the token arrays go

    def __call__(self, params, pool, tokens, starts, lengths, page_tables):
        packed = pack_step(tokens, starts, lengths, page_tables)
        x, starts, lengths, page_tables = self.embed(params["embed"], jax.device_put(packed, self.inputs))
        layers, pool = params["layers"], list(pool)
        for first, count, group in self.groups:
            end = first + count
            x, pool[first:end] = group(layers[first:end], tuple(pool[first:end]), x, starts, lengths, page_tables)
        logits, hidden = self.head(top_params(params), x, lengths)
        return logits, tuple(pool), hidden

    @property
    def logits_sharding(self) -> jax.sharding.Sharding:
        """Where a call leaves its logits (the samplers are compiled for that placement)."""
        return self.head.output_shardings[0]

    def memory_analysis(self) -> MemoryUse:
        """What one call needs beside its arguments: the most scratch memory of any of its programs, and the pool
        bytes written in place (aliased from argument to result) over all its group calls."""
        programs = [self.embed, self.head, *(group for *_, group in self.groups)]
        return MemoryUse(
            temp_size_in_bytes=max(p.memory_analysis().temp_size_in_bytes for p in programs),
            alias_size_in_bytes=sum(group.memory_analysis().alias_size_in_bytes for *_, group in self.groups),
        )


@dataclass(frozen=True)
class OneProgram:
    """A forward shape as one program (``whole_step``): where the model is one group of layers (on a TPU), the
    embedding and the head go in with it, one call a step instead of three. Called like ``LayeredForward``."""

    program: jax.stages.Compiled
    inputs: jax.sharding.Sharding

    def __call__(self, params, pool, tokens, starts, lengths, page_tables):
        packed = jax.device_put(pack_step(tokens, starts, lengths, page_tables), self.inputs)
        logits, pool, hidden = self.program(params, tuple(pool), packed)
        return logits, tuple(pool), hidden

    @property
    def logits_sharding(self) -> jax.sharding.Sharding:
        return self.program.output_shardings[0]

    def memory_analysis(self) -> MemoryUse:
        analysis = self.program.memory_analysis()
        return MemoryUse(analysis.temp_size_in_bytes, analysis.alias_size_in_bytes)


def pack_step(tokens, starts, lengths, page_tables) -> np.ndarray:
    """A step's host inputs as one int32 array ``[B, S + 2 + W]`` (``embed_step`` unpacks it on the device)."""
    ints = lambda a: np.asarray(a, np.int32)  # noqa: E731
    return np.concatenate([ints(tokens), ints(starts)[:, None], ints(lengths)[:, None], ints(page_tables)], axis=1)


@dataclass(frozen=True)
class MemoryUse:
    temp_size_in_bytes: int
    alias_size_in_bytes: int


def _pad_rows(a: np.ndarray, rows: int, cols: int | None = None) -> np.ndarray:
    """``a`` with zero rows added up to ``rows`` (and zero columns up to ``cols``)."""
    out = np.zeros((rows, *((cols,) if cols is not None else a.shape[1:])), a.dtype)
    out[tuple(slice(0, n) for n in a.shape)] = a
    return out
