"""The forward passes a serving node runs, compiled before it serves: one executable per (batch, tokens) shape.

``jax.jit`` compiles a program the first time a shape is called; on a serving node that is a request that waits
seconds, and late compiles grow the process (``docs/serving.md``). So a node compiles ahead, from the shapes its
configuration can form (``prefill_shapes``, ``decode_shapes``), and calls the compiled executables directly.
``jax.stages.Compiled`` is not put back into ``jit``'s cache, which is why the model's wrappers take the
executor (``ForwardPrograms``) rather than relying on ``forward_paged``'s own cache. A shape nobody compiled ahead is
still served, compiled on the spot and counted (``compiles.py``): a bug in the shape lists, not a failure.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import jax
import jax.numpy as jnp

from fsm_pd.model import buckets
from fsm_pd.model.config import ModelConfig
from fsm_pd.model.decoder import forward_paged, table_width
from fsm_pd.model.tensor_parallel import TensorParallel, forward_sharded


def prefill_shapes(max_batch: int, max_tokens: int) -> list[tuple[int, int]]:
    """Every (batch bucket, token bucket) a prefill step can form: up to ``max_batch`` chunks whose padded size stays
    within ``max_tokens`` (``buckets.prefill_fits``; a longer prompt is prefilled in chunks of at most that)."""
    shapes = []
    for batch in _powers_up_to(buckets.batch_bucket(max_batch)):
        for tokens in _powers_up_to(buckets.token_bucket(max_tokens), start=buckets.MIN_TOKEN_BUCKET):
            if buckets.prefill_fits(batch, tokens, max_tokens):
                shapes.append((batch, tokens))
    return shapes


def decode_shapes(max_running: int) -> list[tuple[int, int]]:
    """Every (batch bucket, 1) a decode step of up to ``max_running`` sequences can form."""
    return [(batch, 1) for batch in _powers_up_to(buckets.batch_bucket(max_running))]


def _powers_up_to(limit: int, start: int = 1) -> list[int]:
    out, value = [], start
    while value <= limit:
        out.append(value)
        value *= 2
    return out


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


def programs_for(config: ModelConfig, params: dict, pool: tuple, tp: TensorParallel | None = None) -> ForwardPrograms:
    """The ``ForwardPrograms`` of this model shape over pools like ``pool``, shared by every caller in the process
    (as ``jit``'s own cache is): the executables take the weights as arguments, so one compile serves every copy."""
    signature = lambda arrays: tuple((a.shape, str(a.dtype), placement_key(a.sharding))
                                     for a in jax.tree.leaves(arrays))
    key = (config, signature(pool), signature(params), tp)
    with _SHARED_LOCK:
        programs = _SHARED.get(key)
        if programs is None:
            programs = _SHARED[key] = ForwardPrograms(config, params, pool, tp)
        return programs


class ForwardPrograms:
    """``forward_paged`` compiled for one model and one pool (its shape, dtype and placement), by input shape; with
    ``tp``, its tensor-parallel form (``tensor_parallel.forward_sharded``) over ``tp``'s mesh.

    Called like ``forward_paged`` without ``config``. Thread-safe: a node compiles ahead on its start-up thread, and
    a late compile, should one happen, runs on the model thread.
    """

    def __init__(self, config: ModelConfig, params: dict, pool: tuple, tp: TensorParallel | None = None):
        self.config, self.tp = config, tp
        abstract = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
        self._params = jax.tree.map(abstract, params)  # shapes only: no model's weights are kept alive here
        self._pool = tuple(abstract(a) for a in pool)
        self.width = table_width(config, pool[0].shape[0], pool[0].shape[1])
        self._programs: dict[tuple[int, int], jax.stages.Compiled] = {}
        self._lock = threading.Lock()

    @property
    def shapes(self) -> set[tuple[int, int]]:
        return set(self._programs)

    def compile(self, batch: int, tokens: int) -> jax.stages.Compiled:
        """The executable for ``[batch, tokens]`` inputs, compiled now if it was not yet."""
        with self._lock:
            program = self._programs.get((batch, tokens))
        if program is not None:
            return program
        if self.tp is None:
            ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
            forward, static = forward_paged, {"config": self.config}
        else:  # the host's token arrays go to every device of the mesh
            ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.tp.replicated)
            forward, static = forward_sharded, {"tp": self.tp}
        program = forward.lower(
            self._params, self._pool, ints(batch, tokens), ints(batch), ints(batch), ints(batch, self.width), **static
        ).compile()
        with self._lock:
            return self._programs.setdefault((batch, tokens), program)

    def compile_all(self, shapes: Iterable[tuple[int, int]], on_compiled=lambda shape: None) -> None:
        for shape in shapes:
            self.compile(*shape)
            on_compiled(shape)

    def __call__(self, params, pool, tokens, starts, lengths, page_tables):
        program = self._programs.get(tokens.shape) or self.compile(*tokens.shape)
        return program(params, pool, tokens, starts, lengths, page_tables)
