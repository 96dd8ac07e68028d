"""What runs work whose own program is not compiled yet (a node is ready before every shape is): it must compute
what the missing program would have, and compile nothing.

- a forward pass on a compiled shape that covers it: padded up, or row by row;
- a sampler batch padded up to a prepared bucket;
- a CPU scatter layer by layer on its one-layer program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from side_by_side import forward_shapes

from fsm_pd.kernels import cpu_copy
from fsm_pd.kernels.layout import KVLayout
from fsm_pd.model import compiles, decoder, sampling
from fsm_pd.model.loader import load_model
from fsm_pd.model.programs import ForwardPrograms
from fsm_pd.model.sampling import SamplingParams

# two computations of the model compared (logits, greedy tokens): float32 products at full precision on a TPU
# too (tests/on_chip.py)
pytestmark = [pytest.mark.chip, pytest.mark.usefixtures("full_precision")]  # chip: tests/on_tpu.sh

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]  # 3 rows: a batch bucket of 4, one padding
PAGES = [[1, 2], [3, 4], [5, 6]]


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


def greedy(model, compiled: list[tuple[int, int]], steps: int = 4) -> tuple[list[list[int]], int]:
    """Prefill ``PROMPTS`` as one batch, then decode them together, on programs compiled only for ``compiled``;
    the tokens, and how many programs were compiled on the way."""
    pool = model.make_pool(model.make_kv_layout(64, 16))
    programs = ForwardPrograms(model.config, model.params, pool)  # its own: not the process's shared one
    programs.covers = True
    forward_shapes(programs, compiled)  # side by side (tests/side_by_side.py)
    compiles.install()
    before = sum(compiles.counts().values())
    out = decoder.prefill_batch(model.config, model.params, pool, PROMPTS, PAGES, forward=programs)
    pool, tokens = out.pool, [int(t) for t in np.asarray(out.logits).argmax(-1)]
    seqs, positions = [[t] for t in tokens], [len(p) for p in PROMPTS]
    for _ in range(steps):
        logits, pool = decoder.decode(model.config, model.params, pool, tokens, positions, np.array(PAGES),
                                      forward=programs)
        assert np.isfinite(np.asarray(logits)).all()
        tokens = [int(t) for t in np.asarray(logits).argmax(-1)]
        positions = [p + 1 for p in positions]
        for seq, token in zip(seqs, tokens, strict=True):
            seq.append(token)
    return seqs, sum(compiles.counts().values()) - before


def test_forward_passes_on_covering_shapes_compute_what_their_own_shapes_do(model):
    exact, _ = greedy(model, [(4, 16), (4, 1)])
    for covering in ([(1, 16), (1, 1)], [(8, 32), (8, 1)], [(1, 32), (4, 1)], [(4, 16), (1, 1)]):
        tokens, compiled = greedy(model, covering)
        assert compiled == 0, f"{covering}: compiled while serving"
        assert tokens == exact, f"{covering}: {tokens} != {exact}"


def test_without_a_background_compile_a_missing_shape_compiles_once(model):
    """A node without warm-up (nothing compiles the missing shapes meanwhile) compiles a new shape when it first
    comes, and uses it from then on, rather than run every later batch of that size row by row."""
    pool = model.make_pool(model.make_kv_layout(64, 16))
    programs = ForwardPrograms(model.config, model.params, pool)
    programs.compile(1, 1)
    tables = np.zeros((4, programs.width), np.int32)
    logits, pool, _ = programs(model.params, pool, np.ones((4, 1), np.int32), np.arange(4, dtype=np.int32),
                               np.ones(4, np.int32), tables)
    assert (4, 1) in programs.shapes


def test_cover_prefers_one_call_with_the_fewest_padded_tokens(model):
    pool = model.make_pool(model.make_kv_layout(64, 16))
    programs = ForwardPrograms(model.config, model.params, pool)
    assert programs.cover(1, 1) is None  # nothing compiled: the call compiles its own
    forward_shapes(programs, [(1, 1), (1, 64), (4, 16), (8, 1)])
    assert programs.cover(2, 16) == (4, 16)
    assert programs.cover(1, 20) == (1, 64)
    assert programs.cover(3, 1) == (8, 1)
    assert programs.cover(16, 1) == (8, 1)  # none holds 16 rows: the most rows, in two calls
    assert programs.cover(2, 100) is None


def test_a_decode_batch_runs_padded_up_to_the_largest_decode_program_where_one_call_costs_less(model):
    """A ready node holds the single-row decode and the largest decode batch (``warmup_plan.WarmupPlan.ready_forward``):
    a wide batch runs as one padded call, not one call a row (a decode call costs about the same at any rows); a
    batch of a few rows runs row by row rather than padded to 64."""
    pool = model.make_pool(model.make_kv_layout(64, 16))
    programs = ForwardPrograms(model.config, model.params, pool)
    forward_shapes(programs, [(1, 1), (64, 1), (1, 512)])
    assert programs.cover(16, 1) == (64, 1)
    assert programs.cover(6, 1) == (64, 1)
    assert programs.cover(2, 1) == (1, 1)


def test_a_sampler_batch_pads_up_to_a_prepared_bucket(monkeypatch):
    rng = np.random.default_rng(0)
    # the tiny model's vocabulary: its engines' sampler programs, compiled by the tests before in this process, serve
    # it too (on a chip a sampler program is ~2 s of compile)
    logits = jnp.asarray(rng.normal(size=(4, 272)).astype(np.float32))
    params = [SamplingParams(temperature=0.8, top_p=0.9)] * 3
    monkeypatch.setattr(sampling, "_prepared", set())
    own = sampling.sample(logits, params, [1, 2, 3], [0, 0, 0])
    monkeypatch.setattr(sampling, "_prepared", {1, 8})
    assert sampling.sampling_rows(3) == 8
    assert list(sampling.sample(logits, params, [1, 2, 3], [0, 0, 0])) == list(own)


@pytest.mark.usefixtures("cpu_default")  # the CPU's own scatter: on a TPU host too, on the CPU
def test_a_scatter_runs_layer_by_layer_until_its_whole_program_is_compiled():
    layout = KVLayout(num_layers=4, num_pages=64, page_size=16, kv_heads=2, head_dim=8)
    device = jax.devices("cpu")[0]
    fresh = lambda: tuple(jax.device_put(jnp.zeros(layout.layer_shape, jnp.float32), device) for _ in range(4))
    staging = np.random.default_rng(1).random(layout.staging_shape(8), dtype=np.float32)
    rows = np.zeros(8, np.int32)
    rows[:5] = [3, 9, 4, 10, 11]
    expected = [np.asarray(a) for a in cpu_copy.scatter_loop(fresh(), jnp.asarray(staging), rows, np.int32(5))]
    compiles.install()
    cpu_copy.prepare_scatter(fresh(), 8, 1)
    before = sum(compiles.counts().values())
    layerwise = cpu_copy.scatter(fresh(), jnp.asarray(staging), rows, np.int32(5))
    cpu_copy.prepare_scatter(fresh(), 8, 4)
    whole = cpu_copy.scatter(fresh(), jax.device_put(staging, device), rows, np.int32(5))  # committed or not: one
    assert sum(compiles.counts().values()) == before + 1, "only prepare_scatter's whole program compiled"
    for got in (layerwise, whole):
        assert all(np.array_equal(np.asarray(a), b) for a, b in zip(got, expected, strict=True))
