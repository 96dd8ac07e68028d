"""Gather/scatter bandwidth of the page kernels against a NumPy fancy-index copy of the same bytes.

    python bench/page_copy.py [--json] [--pages 8,40,128] [--impl auto|jnp|pallas|cpu] [--repeats 20]

It also times the same scatter done one layer at a time (``scatter_layers``, as D writes layers while a transfer
is still arriving) and prints its ratio to the all-layers scatter.

Bytes counted are the real pages moved (``n * page_bytes`` across all layers), not the bucket's padding rows, so
padding shows up as lost bandwidth. Page ids are a random sample (few contiguous runs: the worst case for the
run-length-encoded DMA path). ``--impl pallas`` off TPU runs the interpret mode, which measures the simulator, not
a kernel.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from fsm_pd.kernels import KVLayout, gather_pages, page_bucket, resolve_impl, scatter_layers, scatter_pages

LAYOUT = KVLayout(num_layers=4, num_pages=257, page_size=16, kv_heads=4, head_dim=64, dtype="float32")


def median_seconds(run, repeats: int) -> float:
    run()  # warm-up: compile, first-touch allocations
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_pages(pool_np: list[np.ndarray], n: int, impl: str, repeats: int, rng) -> dict:
    ids = rng.choice(np.arange(1, LAYOUT.num_pages), size=n, replace=False).astype(np.int32)
    dst_ids = rng.permutation(ids)
    moved = n * LAYOUT.page_bytes()
    pool = tuple(jnp.asarray(layer) for layer in pool_np)

    gather_s = median_seconds(lambda: gather_pages(pool, ids, impl=impl).block_until_ready(), repeats)
    staging = gather_pages(pool, ids, impl=impl)
    state = {"pool": pool}

    def scatter():
        state["pool"] = scatter_pages(state["pool"], staging, dst_ids, impl=impl)  # donated: carry the new pool
        jax.block_until_ready(state["pool"])

    scatter_s = median_seconds(scatter, repeats)

    staging_np = np.asarray(staging)
    layers = [jnp.asarray(staging_np[i : i + 1]) for i in range(LAYOUT.num_layers)]

    def scatter_by_layer():
        for index, layer in enumerate(layers):
            state["pool"] = scatter_layers(state["pool"], index, layer, dst_ids, impl=impl)
        jax.block_until_ready(state["pool"])

    by_layer_s = median_seconds(scatter_by_layer, repeats)
    numpy_gather_s = median_seconds(lambda: np.stack([layer[ids] for layer in pool_np]), repeats)

    def numpy_scatter():
        for index, layer in enumerate(pool_np):
            layer[dst_ids] = staging_np[index, :n]

    numpy_scatter_s = median_seconds(numpy_scatter, repeats)
    gbps = lambda seconds: moved / seconds / 1e9
    return {
        "pages": n,
        "rows": page_bucket(n),
        "bytes": moved,
        "gather_gbps": gbps(gather_s),
        "scatter_gbps": gbps(scatter_s),
        "numpy_gather_gbps": gbps(numpy_gather_s),
        "numpy_scatter_gbps": gbps(numpy_scatter_s),
        "gather_ratio": numpy_gather_s / gather_s,
        "scatter_ratio": numpy_scatter_s / scatter_s,
        "gather_median_ms": gather_s * 1e3,
        "scatter_median_ms": scatter_s * 1e3,
        "scatter_by_layer_median_ms": by_layer_s * 1e3,
        "scatter_by_layer_ratio": scatter_s / by_layer_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--pages", default="8,40,128", help="comma-separated page counts")
    parser.add_argument("--impl", default="auto", choices=["auto", "jnp", "pallas", "cpu"])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    pool_np = [rng.standard_normal(LAYOUT.layer_shape).astype(np.float32) for _ in range(LAYOUT.num_layers)]
    impl = resolve_impl([jnp.asarray(pool_np[0][:2])], args.impl)
    results = [bench_pages(pool_np, int(n), impl, args.repeats, rng) for n in args.pages.split(",")]
    report = {
        "backend": jax.default_backend(),
        "impl": impl,
        "layout": LAYOUT.to_dict(),
        "page_bytes": LAYOUT.page_bytes(),
        "repeats": args.repeats,
        "results": results,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(
        f"backend={report['backend']} impl={impl} page_bytes={LAYOUT.page_bytes()} (all layers) repeats={args.repeats}"
    )
    # ratio = NumPy time / kernel time: above 1 the kernel is faster than the NumPy copy of the same bytes.
    # by layer = all-layers scatter time / one-layer-at-a-time scatter time: below 1 the per-layer writes cost more.
    print("pages rows     MB | gather GB/s  numpy  ratio  med ms | scatter GB/s  numpy  ratio  med ms | by layer")
    for r in results:
        print(
            f"{r['pages']:5d} {r['rows']:4d} {r['bytes'] / 1e6:6.1f} | {r['gather_gbps']:11.2f}"
            f" {r['numpy_gather_gbps']:6.2f} {r['gather_ratio']:6.2f} {r['gather_median_ms']:7.3f}"
            f" | {r['scatter_gbps']:12.2f}"
            f" {r['numpy_scatter_gbps']:6.2f} {r['scatter_ratio']:6.2f} {r['scatter_median_ms']:7.3f}"
            f" | {r['scatter_by_layer_ratio']:8.2f}"
        )


if __name__ == "__main__":
    main()
