"""What libtpu's premapped host buffer costs the chip's open, and what it gives host copies (issue 50, point 3).

``fsm-pd serve`` asks libtpu for a small buffer (``fsm_pd/runtime/tpu_host_buffer.py``): its default of 4 GiB took
5.2 s of a 5.7 s open on the v5e host. For each size named, a fresh process (one at a time: one process may hold the
chip) imports jax, opens the devices, then copies to the device a --big-mib array twice and an 8 MiB one 20 times,
and back to the host a --big-mib/4 one twice. It prints one line per size and the open's and copies' ratios against
the first size named (libtpu's default by default), and with --json writes them:

    python3 bench/host_buffer.py                      # sizes 0 (libtpu's default), 1024, 256, 64 MiB
    python3 bench/host_buffer.py --sizes 0,256 --big-mib 64 --json out.json

On a CPU the size changes nothing (no libtpu); the figures are the host's own copies.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SIZE_ENV = "TPU_PREMAPPED_BUFFER_SIZE"


def one(big_mib: int) -> dict:
    """This process's open and copies, timed (the size is whatever the environment says)."""
    began = time.perf_counter()
    import jax
    import numpy as np

    imported = time.perf_counter()
    jax.devices()
    figures = {"import_s": round(imported - began, 3), "open_s": round(time.perf_counter() - imported, 3)}
    big = np.arange((big_mib << 20) // 4, dtype=np.uint32)
    ups = []
    for _ in range(2):
        start = time.perf_counter()
        jax.device_put(big).block_until_ready()
        ups.append(time.perf_counter() - start)
    figures["up_big_gbps"] = round(big.nbytes / min(ups) / 1e9, 3)
    small = np.arange((8 << 20) // 4, dtype=np.uint32)
    start = time.perf_counter()
    for _ in range(20):
        jax.device_put(small).block_until_ready()
    figures["up_8mib_ms"] = round((time.perf_counter() - start) / 20 * 1e3, 3)
    on_device = jax.device_put(big[: big.size // 4])
    downs = []
    for step in range(2):
        fresh = (on_device + step).block_until_ready()  # a new array: none of its bytes is on the host yet
        start = time.perf_counter()
        np.asarray(fresh)
        downs.append(time.perf_counter() - start)
    figures["down_gbps"] = round(on_device.nbytes / min(downs) / 1e9, 3)
    figures["platform"] = jax.devices()[0].platform
    return figures


def measure(size_mib: int, big_mib: int, timeout: float) -> dict:
    env = dict(os.environ)
    env.pop(SIZE_ENV, None)
    if size_mib:
        env[SIZE_ENV] = str(size_mib << 20)
    try:
        done = subprocess.run([sys.executable, __file__, "--one", "--big-mib", str(big_mib)], env=env,
                              timeout=timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return {"size_mib": size_mib, "error": f"no figures within {timeout:g} s"}
    if done.returncode != 0:
        return {"size_mib": size_mib, "error": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]}
    return {"size_mib": size_mib, **json.loads(done.stdout.strip().splitlines()[-1])}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="0,1024,256,64",
                        help="the buffer sizes in MiB, comma-separated; 0 is libtpu's own default (4 GiB)")
    parser.add_argument("--big-mib", type=int, default=256, help="the large copy's MiB (default 256)")
    parser.add_argument("--timeout", type=float, default=120, help="seconds each size's process may take")
    parser.add_argument("--json", default=None)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.big_mib)))
        return 0
    rows = [measure(int(size), args.big_mib, args.timeout) for size in args.sizes.split(",")]
    base = rows[0]
    for row in rows:
        if "error" in row:
            print(f"{row['size_mib']:>5} MiB: failed: {row['error']}")
            continue
        ratios = ""
        if "error" not in base and row is not base:
            ratios = (f"  (open {row['open_s'] / max(base['open_s'], 1e-3):.2f}x, "
                      f"up {row['up_big_gbps'] / base['up_big_gbps']:.2f}x, "
                      f"down {row['down_gbps'] / base['down_gbps']:.2f}x the first)")
        name = "default" if row["size_mib"] == 0 else f"{row['size_mib']} MiB"
        print(f"{name:>9}: open {row['open_s']:.2f} s, up {args.big_mib} MiB {row['up_big_gbps']:.2f} GB/s, "
              f"up 8 MiB {row['up_8mib_ms']:.2f} ms, down {args.big_mib // 4} MiB {row['down_gbps']:.2f} GB/s"
              f" [{row['platform']}]{ratios}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"big_mib": args.big_mib, "rows": rows}, handle, indent=1)
    return 0 if all("error" not in row for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
