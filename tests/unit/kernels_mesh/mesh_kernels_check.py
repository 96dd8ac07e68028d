"""Page kernels on a KV pool sharded over a 2-device CPU mesh (KV-head axis split).

Not collected by a plain ``pytest`` run (the name does not start with ``test_``): the device count is fixed when jax
creates its CPU client, so ``tests/unit/test_kernels_mesh.py`` runs this file in a fresh interpreter with
``XLA_FLAGS=--xla_force_host_platform_device_count=2``. Run it by hand the same way::

    XLA_FLAGS=--xla_force_host_platform_device_count=2 pytest tests/unit/kernels_mesh/mesh_kernels_check.py
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from fsm_pd.kernels import KVLayout, gather_pages, page_bucket, scatter_pages

LAYOUT = KVLayout(num_layers=2, num_pages=9, page_size=2, kv_heads=2, head_dim=8, shard_axis="tp")
STAGING_SPEC = PartitionSpec(None, None, None, "tp")


@pytest.fixture(scope="module", autouse=True)
def two_devices():
    if jax.device_count() != 2:
        pytest.fail(f"needs XLA_FLAGS=--xla_force_host_platform_device_count=2, found {jax.device_count()} devices")


def make_mesh(axis_type: AxisType):
    return jax.make_mesh((2,), ("tp",), axis_types=(axis_type,))


def numbered_layers(offset: float = 0.0) -> list[np.ndarray]:
    size = int(np.prod(LAYOUT.layer_shape))
    return [
        (np.arange(size, dtype=np.float32) + layer * size + offset).reshape(LAYOUT.layer_shape)
        for layer in range(LAYOUT.num_layers)
    ]


def sharded(layers: list[np.ndarray], mesh) -> tuple[jax.Array, ...]:
    return tuple(jax.device_put(layer, NamedSharding(mesh, LAYOUT.pool_spec())) for layer in layers)


def assert_placed(array: jax.Array, mesh, spec: PartitionSpec, memory_kind: str | None = None) -> None:
    assert array.sharding.is_equivalent_to(NamedSharding(mesh, spec, memory_kind=memory_kind), array.ndim), (
        array.sharding
    )


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize("impl", ["jnp", "pallas"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_sharded_round_trip_keeps_values_and_sharding(impl, axis_type, data):
    mesh = make_mesh(axis_type)
    pages = list(range(1, LAYOUT.num_pages))
    src_ids = data.draw(st.lists(st.sampled_from(pages), min_size=1, max_size=len(pages), unique=True))
    dst_ids = data.draw(st.permutations(pages)).copy()[: len(src_ids)]
    src, dst = numbered_layers(), numbered_layers(offset=0.5)
    src_pool, dst_pool = sharded(src, mesh), sharded(dst, mesh)

    staging = gather_pages(src_pool, src_ids, impl=impl, layout=LAYOUT)
    assert staging.shape == LAYOUT.staging_shape(page_bucket(len(src_ids)))
    assert_placed(staging, mesh, STAGING_SPEC)
    np.testing.assert_array_equal(np.asarray(staging)[:, : len(src_ids)], np.stack([s[src_ids] for s in src]))

    updated = scatter_pages(dst_pool, staging, dst_ids, impl=impl, layout=LAYOUT)
    assert all(layer.is_deleted() for layer in dst_pool)
    for layer, (got, before, source) in enumerate(zip(updated, dst, src, strict=True)):
        assert_placed(got, mesh, LAYOUT.pool_spec())
        expected = before.copy()
        expected[dst_ids] = source[src_ids]
        np.testing.assert_array_equal(np.asarray(got), expected, err_msg=f"layer {layer}")


@pytest.mark.parametrize("impl", ["jnp", "pallas"])
def test_each_device_copies_only_its_own_heads(impl):
    mesh = make_mesh(AxisType.Explicit)
    src = numbered_layers()
    staging = gather_pages(sharded(src, mesh), [4, 2], impl=impl)
    slots_per_device = LAYOUT.kv_heads // 2
    for shard in staging.addressable_shards:
        device_index = mesh.devices.tolist().index(shard.device)
        lanes = LAYOUT.slot_lanes(device_index * slots_per_device, slots_per_device)
        assert shard.data.shape == (LAYOUT.num_layers, 2, LAYOUT.page_size, lanes.stop - lanes.start)
        np.testing.assert_array_equal(np.asarray(shard.data)[0], src[0][[4, 2]][:, :, lanes])


def test_pools_sharded_on_another_axis_are_rejected():
    mesh = make_mesh(AxisType.Explicit)
    pool = tuple(
        jax.device_put(layer, NamedSharding(mesh, PartitionSpec(None, "tp", None))) for layer in numbered_layers()
    )
    with pytest.raises(ValueError, match=r"only the KV-head axis \(2\) of a pool may be sharded"):
        gather_pages(pool, [1, 2])


def test_a_split_pool_s_placement_is_the_layout_s_own_specs():
    """A pool layer has 3 axes: its placement takes the spec as the layout writes it, no axis added (issue 51), and
    a pool that is only replicated over the mesh splits nothing."""
    from fsm_pd.kernels.placement import pool_placement

    mesh = make_mesh(AxisType.Explicit)
    placement = pool_placement(sharded(numbered_layers(), mesh))
    assert placement.pool_spec == LAYOUT.pool_spec() and placement.staging_spec == LAYOUT.staging_spec() == STAGING_SPEC
    replicated = tuple(jax.device_put(layer, NamedSharding(mesh, PartitionSpec())) for layer in numbered_layers())
    assert pool_placement(replicated).pool_spec == PartitionSpec(None, None, None)
