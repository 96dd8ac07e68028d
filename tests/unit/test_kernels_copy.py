"""gather_pages / scatter_pages against a NumPy reference, for every implementation.

"pallas" runs here in Pallas's TPU interpret mode (HBM, DMAs and DMA semaphores simulated on the CPU, with DMAs
executed only when waited on), so a kernel that forgets a wait or mixes up offsets fails these tests. "cpu" is the
block-copy path that "auto" picks for a pool on one CPU device (recycled host blocks, a donated update loop): its
tests run with the CPU as jax's default device (``cpu_default``), so that on a TPU host too their pools are on the
CPU, while "jnp" and "pallas" run on the chip there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsm_pd.kernels import (
    cpu_copy,
    gather_pages,
    gather_pages_into,
    host_blocks,
    jnp_copy,
    page_bucket,
    pallas_copy,
    resolve_impl,
    scatter_layers,
    scatter_pages,
)

# device programs: on a TPU host they run in the process that holds the chip (tests/on_tpu.sh)
pytestmark = pytest.mark.chip

IMPLS = ["jnp", "pallas", "cpu"]
PAGE_SHAPE = (2, 32)  # page_size, 2*kv_heads*head_dim: tiny, the kernels never look inside a page

# 25 examples a test on the CPU, 10 on a chip: there each example's pool shape and page bucket is a program compiled
# anew (0.2 s or so: the jnp and pallas cases of these three tests drew ~100 programs, 19 s of this file's 33 on a
# v5e), and a wrong offset or a missed DMA wait shows on any of them. The CPU's run draws all 25 of each
# implementation, Pallas's interpret mode simulating the DMAs and their waits.
EXAMPLES = 25 if jax.default_backend() == "cpu" else 10
jit_settings = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def numbered_pool(num_layers: int, num_pages: int, offset: float = 0.0) -> list[np.ndarray]:
    """Layers whose every element is distinct, so any misplaced element shows."""
    size = num_pages * int(np.prod(PAGE_SHAPE))
    return [
        (np.arange(size, dtype=np.float32) + layer * size + offset).reshape(num_pages, *PAGE_SHAPE)
        for layer in range(num_layers)
    ]


def reference_gather(pool: list[np.ndarray], ids: list[int]) -> np.ndarray:
    return np.stack([layer[ids] for layer in pool])  # [L, n, page_size, 2HD]


def reference_scatter(pool: list[np.ndarray], staging: np.ndarray, ids: list[int]) -> list[np.ndarray]:
    out = [layer.copy() for layer in pool]
    for index, layer in enumerate(out):
        layer[ids] = staging[index, : len(ids)]
    return out


def to_device(pool: list[np.ndarray]) -> tuple[jax.Array, ...]:
    """Committed to the first device, as a node's pool is (``LoadedModel.make_pool``) and as a scatter returns one
    (``kernels/pool_format.py`` pins its results' layout, which takes a placement): else the first scatter would
    hand the next call a committed pool, one more program."""
    device = next(iter(jnp.zeros(()).devices()))  # jax's default device now: the CPU under cpu_default
    # a buffer of its own, which XLA allocated: donatable (one ``jax.device_put`` copied from the host was not
    # always reused by the scatter that took it, test_scatter_donates_the_pool found)
    return tuple(jax.device_put(jnp.asarray(layer), device) for layer in pool)


def staged(staging: np.ndarray) -> jax.Array:
    """``staging`` on jax's default device, uncommitted as ``jnp.asarray`` leaves it, in a buffer of its own (the
    reference reads the host array after), without a program of its shape."""
    return jax.device_put(staging, may_alias=False)


@pytest.fixture(autouse=True)
def _cpu_impl_on_the_cpu(request):
    """A test run with impl="cpu" gets the CPU as jax's default device (``cpu_default``); the others keep theirs."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("impl") == "cpu":
        request.getfixturevalue("cpu_default")


@st.composite
def pages_case(draw):
    """(num_layers, num_pages, page ids): ids distinct in [1, num_pages), sometimes sorted so that runs form."""
    num_layers = draw(st.sampled_from([1, 2]))
    num_pages = draw(st.sampled_from([2, 5, 9, 12]))
    ids = draw(st.lists(st.integers(1, num_pages - 1), min_size=1, max_size=num_pages - 1, unique=True))
    if draw(st.booleans()):
        ids.sort()
    return num_layers, num_pages, ids


@pytest.mark.parametrize("impl", IMPLS)
@jit_settings
@given(case=pages_case())
def test_gather_matches_numpy(impl, case):
    num_layers, num_pages, ids = case
    pool = numbered_pool(num_layers, num_pages)
    staging = gather_pages(to_device(pool), ids, impl=impl)
    assert staging.shape == (num_layers, page_bucket(len(ids)), *PAGE_SHAPE)
    np.testing.assert_array_equal(np.asarray(staging)[:, : len(ids)], reference_gather(pool, ids))


@pytest.mark.parametrize("impl", IMPLS)
@jit_settings
@given(case=pages_case())
def test_scatter_matches_numpy_and_never_writes_padding_rows(impl, case):
    num_layers, num_pages, ids = case
    pool = numbered_pool(num_layers, num_pages)
    rows = page_bucket(len(ids))
    staging = -np.stack(numbered_pool(num_layers, rows, offset=1.0))
    staging[:, len(ids) :] = np.nan  # padding rows: if any lands in the pool (page 0 included), equality fails
    updated = scatter_pages(to_device(pool), staged(staging), ids, impl=impl)
    expected = reference_scatter(pool, staging, ids)
    assert len(updated) == num_layers
    for got, want in zip(updated, expected, strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("impl", IMPLS)
@jit_settings
@given(case=pages_case(), data=st.data())
def test_round_trip_moves_pages_between_pools(impl, case, data):
    """Prefill gathers its pages, decode scatters them into different pages of its own pool."""
    num_layers, num_pages, src_ids = case
    dst_ids = data.draw(st.permutations(range(1, num_pages)).map(lambda p: list(p[: len(src_ids)])))
    src = numbered_pool(num_layers, num_pages)
    dst = numbered_pool(num_layers, num_pages, offset=0.25)
    staging = gather_pages(to_device(src), src_ids, impl=impl)
    updated = scatter_pages(to_device(dst), staging, dst_ids, impl=impl)
    for layer in range(num_layers):
        got = np.asarray(updated[layer])
        np.testing.assert_array_equal(got[dst_ids], src[layer][src_ids])
        untouched = np.setdiff1d(np.arange(num_pages), dst_ids)
        np.testing.assert_array_equal(got[untouched], dst[layer][untouched])


@pytest.mark.parametrize("impl", IMPLS)
def test_bfloat16_pool(impl):
    pool = [layer.astype(jnp.bfloat16) for layer in numbered_pool(2, 6)]
    staging = gather_pages(to_device(pool), [4, 1, 2], impl=impl)
    assert staging.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(staging)[:, :3], reference_gather(pool, [4, 1, 2]))
    updated = scatter_pages(to_device(pool), staging, [5, 3, 4], impl=impl)
    np.testing.assert_array_equal(np.asarray(updated[1]), reference_scatter(pool, np.asarray(staging), [5, 3, 4])[1])


@pytest.mark.parametrize("lanes", [384, 512], ids=lambda n: f"lanes-{n}")  # SmolLM2's rows; head_dim 128, 2 KV heads
@pytest.mark.parametrize("page_size", [16, 64, 128], ids=lambda p: f"page-{p}")  # a TPU pool's candidates
@pytest.mark.parametrize("impl", ["jnp", "pallas"])  # what a TPU pool's handoff runs ("pallas": its auto)
def test_a_handoff_round_trip_at_a_tpu_pools_page_sizes(impl, page_size, lanes):
    """Pages of the real shapes, in bfloat16 as on a chip: gathered (a run and scattered pages, padded to the bucket)
    and scattered into another pool's pages, each page whole and only those."""
    rng = np.random.default_rng(page_size + lanes)
    src, dst = (rng.normal(size=(2, 10, page_size, lanes)).astype(jnp.bfloat16) for _ in range(2))
    ids, into = [3, 4, 5, 9, 1], [8, 2, 6, 7, 1]  # 5 pages: a bucket of 8 rows
    staging = gather_pages(to_device(list(src)), ids, impl=impl)
    assert staging.shape == (2, page_bucket(len(ids)), page_size, lanes)
    np.testing.assert_array_equal(np.asarray(staging)[:, :len(ids)], reference_gather(list(src), ids))
    updated = scatter_pages(to_device(list(dst)), staging, into, impl=impl)
    want = reference_scatter(list(dst), np.asarray(staging), into)
    for layer in range(2):
        np.testing.assert_array_equal(np.asarray(updated[layer]), want[layer])


@pytest.mark.parametrize("impl", IMPLS)
def test_scatter_donates_the_pool(impl):
    pool = to_device(numbered_pool(2, 6))
    addresses = [layer.unsafe_buffer_pointer() for layer in pool]
    staging = gather_pages(pool, [1, 2], impl=impl)
    updated = scatter_pages(pool, staging, [4, 5], impl=impl)
    assert all(layer.is_deleted() for layer in pool)
    # XLA reused the donated buffers: the pages were written in place, not into a copy of the pool.
    assert [layer.unsafe_buffer_pointer() for layer in updated] == addresses
    assert not any(layer.is_deleted() for layer in updated)
    with pytest.raises(RuntimeError, match="deleted"):
        np.asarray(pool[0])


@pytest.mark.parametrize("impl", IMPLS)
def test_gather_leaves_the_pool_alive(impl):
    pool = to_device(numbered_pool(2, 6))
    gather_pages(pool, [1, 2, 3], impl=impl)
    assert not any(layer.is_deleted() for layer in pool)


def compiled(impl: str) -> tuple[int, int]:
    """(gather, scatter) compilations so far of the jitted function behind ``impl``."""
    if impl == "jnp":
        return jnp_copy.gather_rows._cache_size(), jnp_copy.scatter_rows._cache_size()
    if impl == "cpu":  # the gather is NumPy block copies: nothing to compile
        return 0, cpu_copy.scatter_loop._cache_size()
    return pallas_copy._gather_jit._cache_size(), pallas_copy._scatter_jit._cache_size()


@pytest.mark.parametrize("impl", IMPLS)
def test_new_lengths_within_a_bucket_do_not_recompile(impl):
    num_pages = 23  # a pool shape no other test uses, so every compile counted here is ours
    pool = to_device(numbered_pool(1, num_pages))
    before = compiled(impl)
    for n in (5, 6, 7, 8):  # one bucket (8 rows); different ids and run patterns each time
        ids = list(range(num_pages - n, num_pages)) if n % 2 else list(range(1, 2 * n, 2))
        staging = gather_pages(pool, ids, impl=impl)
        pool = scatter_pages(pool, staging, ids[::-1], impl=impl)
    gathers = 0 if impl == "cpu" else 1
    assert tuple(a - b for a, b in zip(compiled(impl), before, strict=True)) == (gathers, 1)
    staging = gather_pages(pool, list(range(1, 10)), impl=impl)  # 9 pages: the next bucket (16 rows)
    scatter_pages(pool, staging, list(range(10, 19)), impl=impl)
    assert tuple(a - b for a, b in zip(compiled(impl), before, strict=True)) == (2 * gathers, 2)


@pytest.mark.usefixtures("cpu_default")
def test_auto_is_cpu_for_a_single_device_cpu_pool_and_unknown_names_are_rejected():
    pool = to_device(numbered_pool(1, 3))
    assert pool[0].devices() == {jax.devices("cpu")[0]}
    assert resolve_impl(pool, "auto") == "cpu"
    assert resolve_impl(pool, "jnp") == "jnp"
    assert resolve_impl(pool, "pallas") == "pallas"
    with pytest.raises(ValueError, match="unknown kernel implementation 'triton'"):
        resolve_impl(pool, "triton")


@pytest.mark.usefixtures("cpu_default")
def test_cpu_gather_pads_with_page_0_and_returns_an_aliased_aligned_array():
    pool = numbered_pool(2, 9)
    staging = gather_pages(to_device(pool), [3, 4, 5, 7, 1], impl="cpu")  # runs [3..5], [7], [1]; 8 rows
    assert staging.shape == (2, 8, *PAGE_SHAPE)
    got = np.asarray(staging)
    np.testing.assert_array_equal(got[:, :5], reference_gather(pool, [3, 4, 5, 7, 1]))
    np.testing.assert_array_equal(got[:, 5:], np.stack([np.broadcast_to(layer[0], (3, *PAGE_SHAPE)) for layer in pool]))
    assert staging.unsafe_buffer_pointer() % host_blocks.ALIGNMENT == 0


@pytest.mark.usefixtures("cpu_default")
def test_cpu_gather_recycles_blocks_only_once_nothing_refers_to_them():
    """A live staging array (or a NumPy view of one, as a transfer backend keeps while sending) is never written by
    a later gather; once dropped, its warm block is reused."""
    pool = to_device(numbered_pool(2, 40))
    first = gather_pages(pool, list(range(1, 33)), impl="cpu")  # 32 pages
    kept_view = np.asarray(first)[1]  # a view only: the staging array itself is dropped below
    snapshot = kept_view.copy()
    address = first.unsafe_buffer_pointer()
    del first
    second = gather_pages(pool, list(range(39, 7, -1)), impl="cpu")
    assert second.unsafe_buffer_pointer() != address
    np.testing.assert_array_equal(kept_view, snapshot)
    del kept_view, second
    # jaxlib lets go of an aliased host array asynchronously, after the device buffer is freed; a round trip
    # through the runtime makes that deterministic here.
    jnp.zeros(()).block_until_ready()
    known = cpu_copy.warm_blocks.idle_addresses()
    third = gather_pages(pool, list(range(5, 37)), impl="cpu")
    assert third.unsafe_buffer_pointer() in known
    np.testing.assert_array_equal(np.asarray(third)[:, :32], reference_gather(numbered_pool(2, 40), list(range(5, 37))))


@pytest.mark.usefixtures("cpu_default")
def test_cpu_scatter_loop_stops_at_the_page_count():
    """The loop bound is the real page count, so rows past it (however many the bucket has) are never read."""
    pool = numbered_pool(1, 6)
    staging = np.full((1, 4, *PAGE_SHAPE), np.nan, np.float32)
    staging[0, 0] = -1.0
    updated = cpu_copy.scatter_loop(
        to_device(pool), staged(staging), np.array([2, 0, 0, 0], np.int32), np.int32(1)
    )
    expected = pool[0].copy()
    expected[2] = -1.0
    np.testing.assert_array_equal(np.asarray(updated[0]), expected)


@pytest.mark.usefixtures("cpu_default")
@jit_settings
@given(case=pages_case())
def test_gather_pages_into_fills_layers_in_order_and_matches_the_reference(case):
    num_layers, num_pages, ids = case
    pool = numbered_pool(num_layers, num_pages)
    out = np.full((num_layers, page_bucket(len(ids)), *PAGE_SHAPE), -1.0, np.float32)
    finished = []

    def on_layer(index):  # the layer just reported is final; the next one is not written yet
        np.testing.assert_array_equal(out[index, : len(ids)], reference_gather(pool, ids)[index])
        if index + 1 < num_layers:
            assert (out[index + 1] == -1.0).all()
        finished.append(index)

    gather_pages_into(to_device(pool), ids, out, on_layer=on_layer)
    assert finished == list(range(num_layers))
    np.testing.assert_array_equal(out[:, : len(ids)], reference_gather(pool, ids))
    np.testing.assert_array_equal(out[:, len(ids) :], np.broadcast_to(np.stack(pool)[:, :1], out[:, len(ids) :].shape))


@pytest.mark.usefixtures("cpu_default")
def test_gather_pages_into_rejects_a_wrong_buffer_before_writing():
    pool = to_device(numbered_pool(2, 9))
    with pytest.raises(ValueError, match="expected float32"):
        gather_pages_into(pool, [1, 2, 3], np.zeros((2, 2, *PAGE_SHAPE), np.float32))  # 3 pages need 4 rows
    with pytest.raises(ValueError, match="expected float32"):
        gather_pages_into(pool, [1, 2], np.zeros((2, 2, *PAGE_SHAPE), np.float16))
    with pytest.raises(ValueError, match="appear more than once"):
        gather_pages_into(pool, [1, 1], np.zeros((2, 2, *PAGE_SHAPE), np.float32))


@pytest.mark.parametrize("impl", ["jnp", "cpu"])
@pytest.mark.parametrize(("start", "count"), [(0, 1), (1, 2), (0, 4), (3, 1)])
def test_scatter_layers_writes_only_its_layers(impl, start, count):
    pool, source = numbered_pool(4, 9), numbered_pool(4, 9, offset=1e6)
    ids = [7, 2, 5]
    staging = reference_gather(source, [1, 2, 3, 4])  # 4 rows: one padding row past the 3 pages
    updated = scatter_layers(to_device(pool), start, staged(staging[start : start + count]), ids, impl=impl)
    expected = reference_scatter(pool, staging, ids)
    for layer in range(4):
        want = expected[layer] if start <= layer < start + count else pool[layer]
        np.testing.assert_array_equal(np.asarray(updated[layer]), want)


def test_scatter_layers_rejects_layers_outside_the_pool():
    with pytest.raises(ValueError, match="out of range"):
        scatter_layers(to_device(numbered_pool(2, 9)), 1, jnp.zeros((2, 2, *PAGE_SHAPE)), [1, 2])
