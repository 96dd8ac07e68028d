"""What both processes of ``bench/transfer.py`` build alike: the payloads, the KV layouts and pools, the page ids
and the jax transfer server's settings. Importing it arms ``FSM_PD_BENCH_HANG_DUMP`` in either process."""

from __future__ import annotations

import argparse
import os

import numpy as np

if os.environ.get("FSM_PD_BENCH_HANG_DUMP"):
    import faulthandler

    faulthandler.dump_traceback_later(float(os.environ["FSM_PD_BENCH_HANG_DUMP"]), exit=True)

PAGE_SIZE, KV_HEADS, HEAD_DIM = 16, 8, 128  # one page of one layer = 128 KiB of float32


def layer_arrays(mib: int, layers: int, seed: int = 0) -> list[np.ndarray]:
    n = (mib << 20) // 4 // layers
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n, dtype=np.float32) for _ in range(layers)]


def kv_layout(mib: int, layers: int, tp: int = 1):
    from fsm_pd.kernels import KVLayout

    pages = (mib << 20) // (layers * PAGE_SIZE * 2 * KV_HEADS * HEAD_DIM * 4)
    layout = KVLayout(
        num_layers=layers, num_pages=2 * pages + 1, page_size=PAGE_SIZE, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
        shard_axis="tp" if tp > 1 else None, tp=tp,
    )
    return layout, pages


def split_pool(pool: tuple, layout):
    """``pool`` split over the first ``layout.tp`` devices on its KV-head axis (KV_HEADS divides every tp used
    here, so the values do not move: slot i holds head i)."""
    import jax
    from jax.sharding import Mesh, NamedSharding

    if layout.tp == 1:
        return pool
    sharding = NamedSharding(Mesh(np.array(jax.devices()[: layout.tp]), ("tp",)), layout.pool_spec())
    return tuple(jax.device_put(layer, sharding) for layer in pool)


def reshard_pairs(text: str) -> list[tuple[int, int]]:
    return [tuple(int(n) for n in pair.split(":")) for pair in text.split(",") if pair]


def host_devices(args: argparse.Namespace) -> None:
    """Virtual CPU devices for the largest split, asked for before this process imports jax."""
    sizes = [n for pair in reshard_pairs(args.reshard) for n in pair]
    if sizes and max(sizes) > 1:
        from fsm_pd.cli.serve import ask_for_host_devices

        ask_for_host_devices(max(sizes))


def page_ids(layout, pages: int, seed: int) -> np.ndarray:
    """Scattered (not contiguous) page ids, as after a while of allocation."""
    return np.random.default_rng(seed).permutation(np.arange(1, layout.num_pages))[:pages].astype(np.int32)


def make_pool(layout, seed: int):
    import jax

    rng = np.random.default_rng(seed)
    return tuple(
        jax.device_put(rng.standard_normal(layout.layer_shape, dtype=np.float32)) for _ in range(layout.num_layers)
    )


def server_config(opts: dict):
    """The jax transfer-server settings of the ``jax`` backend options (both baselines share that server)."""
    import dataclasses

    from fsm_pd.transport.backends.jax_api import ServerConfig

    names = {f.name for f in dataclasses.fields(ServerConfig)}
    return ServerConfig(**{k: v for k, v in opts.get("jax", {}).items() if k in names})
