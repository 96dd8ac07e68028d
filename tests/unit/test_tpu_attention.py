"""The TPU kernels (``kernels.kv_write``, ``model.decode_attention``) against the jnp path, through the whole model.
(``test_decode_attention.py`` holds the decode kernel alone to the jnp path on ragged batches, block by block.)

On a TPU they run natively; elsewhere in Pallas's TPU interpret mode, which simulates HBM, VMEM and the DMAs on the
CPU, so a wrong page, a missed wait or a stale buffer shows here too. Each case runs the same calls through
``decoder.forward_paged`` twice, once per kernel set, and compares the logits and the pools: prefill, a second chunk
of a prompt (start > 0, its first page partly written), a prefix hit (new rows after pages another request wrote),
decode steps of a batch with a padding row, for head_dim 64 (a head's K and V share a 128-lane group) and 128, at
16, 64 and 128 tokens a page (a TPU pool's candidates: ``kernels/layout.py``'s ``PAGE_SIZES``; the calls are laid out
in pages, so each size sees the same cases).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from side_by_side import side_by_side

from fsm_pd.kernels.kv_write import pages_spanned, touched_pages
from fsm_pd.model import decoder
from fsm_pd.model.params import random_params
from fsm_pd.model.tiny import tiny_config

# two computations of the model compared (logits, greedy tokens): float32 products at full precision on a TPU
# too (tests/on_chip.py)
pytestmark = [pytest.mark.chip, pytest.mark.usefixtures("full_precision")]  # chip: tests/on_tpu.sh

ON_TPU = jax.default_backend() == "tpu"
KERNELS = "tpu" if ON_TPU else "interpret"
PAGE_SIZES = (16, 64, 128)
# On the CPU both paths are float32 to the last bits but for summation order. On a TPU the two differ by how the
# chip multiplies float32 outside the attention (one bfloat16 pass by default, in both runs alike) and inside it
# (the Pallas kernel and XLA's einsum); a wrong page, row or block still moves a logit by far more than this.
TOLERANCE = 3e-2 if ON_TPU else 2e-4

SHAPES = {  # head_dim: (heads, kv_heads)
    64: (9, 3),  # SmolLM2's grouping
    128: (4, 2),
}


@pytest.fixture(scope="module", params=sorted(SHAPES), ids=lambda d: f"head_dim-{d}")
def model(request):
    heads, kv_heads = SHAPES[request.param]
    config = dataclasses.replace(tiny_config(), num_heads=heads, num_kv_heads=kv_heads, head_dim=request.param,
                                 hidden_size=128, num_layers=1)  # the kernels are per layer: one shows them
    return config, random_params(config, seed=5, std=0.1)


NUM_PAGES = 24


def fresh_pool(config, page_size, num_pages=NUM_PAGES):
    device = jax.devices()[0]
    shape = (num_pages, page_size, 2 * config.num_kv_heads * config.head_dim)
    return tuple(jax.device_put(jnp.zeros(shape, jnp.float32), device) for _ in range(config.num_layers))


def compile_ahead(config, params, calls, page_size):
    """The programs ``run_both`` runs (each kernel set at each call's shape), compiled side by side
    (tests/side_by_side.py): on a chip each takes a second or more to compile, most of this module's time. Each is then
    in ``forward_paged``'s own cache, where the calls find it."""
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    rows = 2 * config.num_kv_heads * config.head_dim
    pool = tuple(jax.ShapeDtypeStruct((NUM_PAGES, page_size, rows), jnp.float32, sharding=device)
                 for _ in range(config.num_layers))  # as ``fresh_pool`` makes it, and as each call returns it
    shapes = sorted({tuple(np.shape(a) for a in call) for call in calls})
    ints = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731 - host arrays: placed by the call
    side_by_side([lambda kernels=kernels, shape=shape: decoder.forward_paged.lower(
        params, pool, *map(ints, shape), config=config, kernels=kernels).compile()
        for kernels in ("jnp", KERNELS) for shape in shapes])


def run_both(config, params, calls, page_size):
    """Run ``calls`` (``(tokens, starts, lengths, tables)`` each, host arrays) through both kernel sets from empty
    pools; returns each set's logits per call and final pool."""
    compile_ahead(config, params, calls, page_size)
    out = {}
    for kernels in ("jnp", KERNELS):
        pool, logits = fresh_pool(config, page_size), []
        forward = partial(decoder.forward_paged, config=config, kernels=kernels)
        for tokens, starts, lengths, tables in calls:
            # host arrays, as jit takes them (``jnp.asarray`` of a list compiles a program of its shape)
            step_logits, pool, _ = forward(params, pool, *(np.asarray(a, np.int32) for a in
                                                           (tokens, starts, lengths, tables)))
            logits.append(np.asarray(step_logits))
        out[kernels] = logits, [np.asarray(layer) for layer in pool]
    return out


def assert_same(out, rows_per_call):
    (want_logits, want_pool), (got_logits, got_pool) = out["jnp"], out[KERNELS]
    for call, (want, got) in enumerate(zip(want_logits, got_logits, strict=True)):
        real = rows_per_call[call]
        np.testing.assert_allclose(got[real], want[real], atol=TOLERANCE, rtol=TOLERANCE, err_msg=f"call {call}")
    for layer, (want, got) in enumerate(zip(want_pool, got_pool, strict=True)):
        # page 0 is the pad page: the jnp path stores padding tokens there, the TPU write never touches it
        np.testing.assert_allclose(got[1:], want[1:], atol=TOLERANCE / 20, err_msg=f"layer {layer}")
        assert not got[0].any(), "the TPU write touched the pad page"


def table(*pages, width=8):
    return list(pages) + [0] * (width - len(pages))


@pytest.mark.parametrize("page_size", PAGE_SIZES, ids=lambda p: f"page-{p}")
def test_prefill_chunks_prefix_hits_and_decode_match_jnp(model, page_size):
    config, params = model
    p, half, quarter = page_size, page_size // 2, page_size // 4
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, 250, size=2 * p + half).tolist()
    a_pages, b_pages = [7, 3, 12], [7, 3, 19, 5]  # b shares a's first two pages: a prefix hit of 2 pages
    calls = [
        # a's first chunk (a page and a half: page 7 whole, page 3 half) and b's would-be rows padded out
        ([prompt[:p + half], [0] * (p + half)], [0, 0], [p + half, 0], [table(*a_pages), table()]),
        # a's second chunk starts mid-page 3 and ends mid-page 12
        ([prompt[p + half:] + [0] * half], [p + half], [p], [table(*a_pages)]),
        # b: after the prefix hit (2 pages: 7, 3), a page and a quarter of new tokens into pages 19 and 5, padded as
        # long as a's second chunk: one program for both (on a chip each program of a kernel set is seconds)
        ([rng.integers(1, 250, size=p + quarter).tolist() + [0] * (half - quarter)], [2 * p], [p + quarter],
         [table(*b_pages)]),
    ]
    decode_rows = [[int(rng.integers(1, 250))] for _ in range(2)]
    for step in range(3):  # a at 2.5 pages.., b at 3.25 pages..; a padding row rides along
        calls.append((decode_rows + [[0]], [2 * p + half + step, 3 * p + quarter + step, 0], [1, 1, 0],
                      [table(*a_pages), table(*b_pages), table()]))
    assert_same(run_both(config, params, calls, page_size), [[0], [0], [0]] + [[0, 1]] * 3)


def test_the_write_touches_only_the_pages_its_tokens_land_in():
    tables = jnp.asarray([[4, 9, 2, 0], [6, 0, 0, 0]], jnp.int32)
    # under jit, as the kernels run it: op by op it was 14 programs, each compiled for the chip
    touched = jax.jit(touched_pages, static_argnums=(3, 4))
    pages = touched(tables, jnp.asarray([14, 3], jnp.int32), jnp.asarray([5, 0], jnp.int32), 5, 8)
    assert pages_spanned(5, 8) == 2
    assert np.asarray(pages).tolist() == [[9, 2], [0, 0]]  # positions 14..18: pages 1 and 2; row 1 writes nothing
