"""The device KV hash (``kernels/kv_hash.py``) against a gather of the same pages, on whatever jax's default device is.

    python bench/device_checksum.py [--sizes 64,256] [--repeats 20] [--dtype bfloat16]

A bf16 pool shaped like SmolLM2-135M's on a TPU (30 layers, 16-token pages, 3 KV heads of 64: rows of 384 values),
random page ids. For each handoff size (MiB of real pages across layers) it prints the median time of the hash, of
``gather_pages`` of the same pages (a read and a write of those bytes: what a copy costs on this device), the
hash's read bandwidth, and the hash time over the gather time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from fsm_pd.kernels import KVLayout, gather_pages
from fsm_pd.kernels.kv_hash import device_checksums


def median_seconds(run, repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="64,256")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--pages", type=int, default=4096)
    args = parser.parse_args()
    lay = KVLayout(num_layers=30, num_pages=args.pages, page_size=16, kv_heads=3, head_dim=64, dtype=args.dtype)
    key = jax.random.PRNGKey(0)
    pool = tuple(jax.random.normal(jax.random.fold_in(key, i), lay.layer_shape, jnp.float32).astype(lay.dtype)
                 for i in range(lay.num_layers))
    jax.block_until_ready(pool)
    rng = np.random.default_rng(0)
    print(f"device: {jax.devices()[0].device_kind}; page {lay.page_bytes() / 1024:.0f} KiB across layers")
    for mib in (int(s) for s in args.sizes.split(",")):
        n = (mib << 20) // lay.page_bytes()
        pages = rng.choice(np.arange(1, lay.num_pages), n, replace=False).tolist()
        hashed = median_seconds(lambda p=pages: device_checksums(pool, p, [(0, 0, lay.slots)], lay.head_dim),
                                args.repeats)
        gathered = median_seconds(lambda p=pages: gather_pages(pool, p, layout=lay).block_until_ready(),
                                  args.repeats)
        size = n * lay.page_bytes()
        print(f"{mib:4d} MiB ({n} pages): hash {hashed * 1e3:7.2f} ms ({size / hashed / 1e9:6.1f} GB/s read), "
              f"gather {gathered * 1e3:7.2f} ms, hash/gather {hashed / gathered:.2f}")


if __name__ == "__main__":
    main()
