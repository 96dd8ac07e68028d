"""KV bytes leaving the device and coming back: which layout and which way of copying reaches the host link's speed.

A handoff over the tcp or zmq backend copies the gathered pages (the staging array, ``[layers, pages, page_size,
lanes]`` in the pool's dtype) to the host, and the receiver copies them back. On the TPU v5e a 64 MiB bfloat16
staging array reached the host at 0.67-0.70 GB/s, a plain float32 array at 3.2, and the link carries about 13 GB/s
(issue 49, point 5; ``docs/tpu.md``). A TPU lays a bfloat16 array out in tiles whose rows interleave pairs of
values, so the host must de-tile what it receives; an array of 32-bit words 128 wide is laid out in tiles of 8 whole
rows, which in row-major order is the bytes as they stand. This times, for one staging array of the model's shape:

- ``as_is``: ``np.asarray`` of the staging array (what the backends do today);
- ``words``: the same bytes as ``uint32[n, 128]`` (bitcast and reshaped on the device, its time apart), then read;
- ``words_async``: that array in --chunks pieces, each ``copy_to_host_async`` at once, then read;
- ``words_pinned``: that array put in the device's pinned host memory, then read (where the device has some);
- and back: ``device_put`` of the staging bytes as they are, and as ``uint32[n, 128]``.

Each way's bytes on the host are checked equal to ``as_is``'s, so a way that is faster is also a way the wire format
could take unchanged. Medians of --repeat fresh copies (a jax array keeps its host copy once made).

    python bench/host_copy.py [--model smollm2-135m] [--mib 64] [--chunks 4] [--repeat 5] [--json out.json]
    python bench/host_copy.py --quick      # the tiny model, 2 MiB: what CI runs to keep it working
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tpu  # noqa: E402 - beside this script: the models it measures

from fsm_pd.kernels import gather_pages  # noqa: E402

LANES = 128  # a TPU tile's width: 128 words of 32 bits


@jax.jit
def as_words(staging):
    """``staging``'s bytes as ``uint32[n, 128]``: row-major order kept (pairs of 16-bit values, little-endian)."""
    flat = staging.reshape(-1)
    if flat.dtype.itemsize == 2:
        flat = jax.lax.bitcast_convert_type(flat.reshape(-1, 2), jnp.uint32)
    elif flat.dtype.itemsize == 4:
        flat = jax.lax.bitcast_convert_type(flat, jnp.uint32)
    return flat.reshape(-1, LANES)


def staging_array(model, mib: float, page_size: int = 16):
    """A staging array of about ``mib`` MiB: every layer's pages gathered as a handoff gathers them (its rows
    rounded up to the gather's bucket, as a handoff's are), the pool filled with noise so that no copy can skip
    zeros."""
    layout = model.make_kv_layout(2, page_size)
    per_page = layout.page_bytes()  # every layer
    pages = max(1, int(mib * 2**20 // per_page))
    while pages * per_page % (4 * LANES):  # whole rows of 128 words
        pages += 1
    pool = model.make_pool(model.make_kv_layout(pages + 1, page_size))
    key = jax.random.key(0)
    pool = tuple(jax.random.normal(jax.random.fold_in(key, i), p.shape, jnp.float32).astype(p.dtype)
                 for i, p in enumerate(pool))
    return jax.block_until_ready(gather_pages(pool, list(range(1, pages + 1))))


def _median_seconds(make, read, repeat: int) -> tuple[float, bytes]:
    """Median seconds of ``read(make())`` over fresh arrays (``make`` untimed), and the last read's bytes."""
    times, data = [], b""
    for _ in range(repeat):
        fresh = jax.block_until_ready(make())
        start = time.perf_counter()
        out = read(fresh)
        times.append(time.perf_counter() - start)
        data = out
    return statistics.median(times), data


def measure(staging, *, chunks: int, repeat: int) -> dict:
    device = next(iter(staging.devices()))
    nbytes = staging.nbytes
    rate = lambda s: round(nbytes / s / 1e9, 3)  # noqa: E731
    as_is_s, reference = _median_seconds(lambda: staging + 0, lambda a: np.asarray(a).tobytes(), repeat)
    words = as_words(staging)
    to_words_s = _median_seconds(lambda: staging + 0, lambda a: jax.block_until_ready(as_words(a)), repeat)[0]
    out = {"MiB": round(nbytes / 2**20, 2), "staging": f"{staging.dtype}{list(staging.shape)}",
           "words_shape": f"uint32{list(words.shape)}", "to_words_ms": round(to_words_s * 1e3, 3),
           "as_is": {"GBps": rate(as_is_s), "same_bytes": True}}

    def read_words(a):
        return np.asarray(a).tobytes()

    def read_async(a):
        pieces = np.array_split(np.arange(a.shape[0]), chunks)
        parts = [a[p[0]:p[-1] + 1] for p in pieces if len(p)]
        for part in parts:
            part.copy_to_host_async()
        return b"".join(np.asarray(part).tobytes() for part in parts)

    ways = {"words": read_words, "words_async": read_async}
    if "pinned_host" in [m.kind for m in device.addressable_memories()]:
        pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
        ways["words_pinned"] = lambda a: np.asarray(jax.device_put(a, pinned)).tobytes()
    for name, read in ways.items():
        seconds, data = _median_seconds(lambda: words + 0, read, repeat)
        out[name] = {"GBps": rate(seconds), "same_bytes": data == reference, "vs_as_is": round(as_is_s / seconds, 2)}
    host = np.frombuffer(reference, staging.dtype).reshape(staging.shape)
    host_words = np.frombuffer(reference, np.uint32).reshape(words.shape)
    up_s = statistics.median(_time(lambda: jax.device_put(host, device)) for _ in range(repeat))
    up_words_s = statistics.median(_time(lambda: jax.device_put(host_words, device)) for _ in range(repeat))
    out["up_as_is"] = {"GBps": rate(up_s)}
    out["up_words"] = {"GBps": rate(up_words_s), "vs_as_is": round(up_s / up_words_s, 2)}
    return out


def _time(fn) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="a shape of bench/tpu.py (default smollm2-135m)")
    parser.add_argument("--mib", type=float, default=64.0, help="the staging array's size (default 64 MiB)")
    parser.add_argument("--chunks", type=int, default=4, help="pieces of words_async (default 4)")
    parser.add_argument("--repeat", type=int, default=5, help="copies timed per way (median; default 5)")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on an accelerator, float32 on a CPU")
    parser.add_argument("--quick", action="store_true", help="the tiny model, 2 MiB, 3 copies (CI)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    dtype = args.dtype or ("float32" if device.platform == "cpu" else "bfloat16")
    if args.quick:
        args.mib, args.repeat = 2.0, 3
    model, weights = tpu.make_model(args.model, dtype, args.quick)
    report = {"device": f"{device.platform}: {device.device_kind}", "model": f"{model.name} ({weights})",
              "dtype": dtype, **measure(staging_array(model, args.mib), chunks=args.chunks, repeat=args.repeat)}
    print(json.dumps(report), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0 if all(v.get("same_bytes", True) for v in report.values() if isinstance(v, dict)) else 1


if __name__ == "__main__":
    sys.exit(main())
