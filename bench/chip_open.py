"""What opening the devices costs a start, and whether other threads can work meanwhile.

A node opens jax's devices on a thread of its own while its main thread imports the server and a third reads the
model (``cli/side_by_side.py``). On the TPU host that overlap did not show: a warm colocated start spent 12.7 s in its
imports (4.7 s cold) beside a 10.9 s open, as if the open held the interpreter's lock. This probe, in a fresh process:

1. imports jax (seconds);
2. opens the devices on a thread while the main thread counts a pure-Python loop in 0.1 s slices, then counts the
   same loop for 1 s after: the ratio of the two medians is the share of the interpreter the open left to others
   (about 1.0: it releases the lock; near 0: it holds it);
3. with ``--lower``, also traces and lowers a small program for the platform named while the devices open, to see
   whether lowering waits for them (jax's ``lowering_platforms``), then compiles it once they are open.

    python3 bench/chip_open.py [--lower] [--platform tpu] [--json FILE]

It prints one line per figure and, with ``--json``, writes them. On a CPU the open is quick and the ratio about 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path


def loop_rate(stop) -> list[int]:
    """Iterations of an empty loop in each 0.1 s slice until ``stop()``."""
    slices = []
    while not stop():
        began, n = time.perf_counter(), 0
        while time.perf_counter() - began < 0.1:
            n += 1
        slices.append(n)
    return slices


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lower", action="store_true", help="also lower a program while the devices open")
    parser.add_argument("--platform", default=None, help="the platform to lower for (default: jax's default one, "
                        "read before the open from JAX_PLATFORMS, else tpu)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    began = time.perf_counter()
    import jax
    import jax.numpy as jnp

    figures: dict = {"import_s": round(time.perf_counter() - began, 3)}
    opened = threading.Event()

    def open_devices() -> None:
        start = time.perf_counter()
        figures["devices"] = [str(d) for d in jax.devices()]
        figures["open_s"] = round(time.perf_counter() - start, 3)
        opened.set()

    opener = threading.Thread(target=open_devices, name="open-devices")
    opener.start()
    lowered = None
    if args.lower:
        import os

        platform = args.platform or (os.environ.get("JAX_PLATFORMS") or "tpu").split(",")[0]
        program = jax.jit(lambda a, b: jnp.tanh(a @ b).sum(0))
        shape = jax.ShapeDtypeStruct((512, 512), jnp.bfloat16)
        start = time.perf_counter()
        try:
            lowered = program.trace(shape, shape).lower(lowering_platforms=(platform,))
            figures["lower"] = "ok"
        except Exception as exc:  # noqa: BLE001 - what it says is the figure
            figures["lower"] = f"{type(exc).__name__}: {exc}"[:300]
        figures["lower_s"] = round(time.perf_counter() - start, 3)
        figures["open_before_lowered"] = opened.is_set()
    during = loop_rate(opened.is_set)
    opener.join()
    until = time.perf_counter() + 1.0
    after = loop_rate(lambda: time.perf_counter() > until)
    figures["loop_during_open"] = statistics.median(during) if during else None
    figures["loop_after_open"] = statistics.median(after)
    if during:
        figures["share_left_to_others"] = round(figures["loop_during_open"] / figures["loop_after_open"], 3)
    if lowered is not None:
        start = time.perf_counter()
        lowered.compile()
        figures["compile_after_open_s"] = round(time.perf_counter() - start, 3)
    for key, value in figures.items():
        print(f"{key}: {value}")
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
