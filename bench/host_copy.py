"""KV bytes leaving the device and coming back: which layout and which way of copying reaches the host link's speed.

A handoff over the tcp or zmq backend copies the gathered pages (the staging array, ``[layers, pages, page_size,
lanes]`` in the pool's dtype) to the host, and the receiver copies them back. On the TPU v5e a 64 MiB bfloat16
staging array reached the host at 0.67-0.70 GB/s, a plain float32 array at 3.2, and the link carries about 13 GB/s
(issue 49, point 5; ``docs/tpu.md``). A TPU lays a bfloat16 array out in tiles whose rows interleave pairs of
values, so the host must de-tile what it receives; an array of 32-bit words 128 wide is laid out in tiles of 8 whole
rows, which in row-major order is the bytes as they stand. The backends copy that way where a program for the array
is prepared (``fsm_pd/kernels/host_words.py``, whose functions this uses). This times, for one staging array of the
model's shape:

- ``as_is``: ``np.asarray`` of the staging array (the plain way, where no program is prepared);
- ``words``: the same bytes as ``uint32[n, 128]`` (made on the device by ``host_words.to_words``, its time apart:
  ``to_words_ms``), then read;
- ``words_async``: that array in --chunks pieces, each ``copy_to_host_async`` at once, then read;
- ``words_pinned``: that array put in the device's pinned host memory, then read (where the device has some);
- ``served``: what the backends run, ``host_words.HostCopy`` with its program prepared: to words and to the host,
  end to end;
- and back: ``device_put`` of the staging bytes as they are (``up_as_is``), as ``uint32[n, 128]`` (``up_words``),
  and ``host_words.to_device`` end to end, the words turned back on the device (``up_served``; that step alone:
  ``from_words_ms``);
- with --backends (default ``tcp,zmq``): a whole handoff in this process, P's backend publishing a fresh staging
  array and D's pulling it over a unix socket until it is on the device, without words (``handoff_tcp_plain``) and
  with every program prepared (``handoff_tcp_words``), as two nodes of the serving code run it.

Each way's bytes on the host (and each handoff's on the device) are checked equal to ``as_is``'s, so a way that is
faster is also a way the wire format could take unchanged. Medians of --repeat fresh copies (a jax array keeps its
host copy once made); the plain ways all run before any program is prepared.

    python bench/host_copy.py [--model smollm2-135m] [--mib 64] [--chunks 4] [--repeat 5] [--backends tcp,zmq]
                              [--json out.json]
    python bench/host_copy.py --quick      # the tiny model, 2 MiB: what CI runs to keep it working
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tpu  # noqa: E402 - beside this script: the models it measures

from fsm_pd.kernels import gather_pages, host_words  # noqa: E402
from fsm_pd.transport.backends import create_backend, new_uuid  # noqa: E402

LANES = host_words.LANES
to_words = jax.jit(host_words.to_words)  # the serving programs' own functions, compiled here to time them apart
from_words = jax.jit(host_words.from_words, static_argnums=(1, 2))


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


def measure(staging, *, chunks: int, repeat: int, backends: list[str]) -> dict:
    device = next(iter(staging.devices()))
    nbytes = staging.nbytes
    rate = lambda s: round(nbytes / s / 1e9, 3)  # noqa: E731
    fresh = lambda: staging + 0  # noqa: E731 - a new device array: a jax array keeps its host copy once made
    host_words.forget()  # the plain ways first, with no program prepared
    before = Counter(host_words.copies)
    as_is_s, reference = _median_seconds(fresh, lambda a: np.asarray(a).tobytes(), repeat)
    host = np.frombuffer(reference, staging.dtype).reshape(staging.shape)
    words = to_words(staging)
    out = {"MiB": round(nbytes / 2**20, 2), "staging": f"{staging.dtype}{list(staging.shape)}",
           "words_shape": f"uint32{list(words.shape)}", "fits": host_words.fits(staging.shape, staging.dtype),
           "as_is": {"GBps": rate(as_is_s), "same_bytes": True}}
    to_words_s = _median_seconds(fresh, lambda a: jax.block_until_ready(to_words(a)), repeat)[0]
    from_words_s = _median_seconds(lambda: words + 0, lambda w: jax.block_until_ready(
        from_words(w, staging.shape, staging.dtype)), repeat)[0]
    out["to_words_ms"], out["from_words_ms"] = round(to_words_s * 1e3, 3), round(from_words_s * 1e3, 3)

    def read_async(a):
        pieces = np.array_split(np.arange(a.shape[0]), chunks)
        parts = [a[p[0]:p[-1] + 1] for p in pieces if len(p)]
        for part in parts:
            part.copy_to_host_async()
        return b"".join(np.asarray(part).tobytes() for part in parts)

    ways = {"words": lambda a: np.asarray(a).tobytes(), "words_async": read_async}
    if "pinned_host" in [m.kind for m in device.addressable_memories()]:
        pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
        ways["words_pinned"] = lambda a: np.asarray(jax.device_put(a, pinned)).tobytes()
    for name, read in ways.items():
        seconds, data = _median_seconds(lambda: words + 0, read, repeat)
        out[name] = {"GBps": rate(seconds), "same_bytes": data == reference, "vs_as_is": round(as_is_s / seconds, 2)}
    host_words_array = np.frombuffer(reference, np.uint32).reshape(words.shape)
    up_s = statistics.median(_time(lambda: jax.device_put(host, device)) for _ in range(repeat))
    up_words_s = statistics.median(_time(lambda: jax.device_put(host_words_array, device)) for _ in range(repeat))
    out["up_as_is"] = {"GBps": rate(up_s)}
    out["up_words"] = {"GBps": rate(up_words_s), "vs_as_is": round(up_s / up_words_s, 2)}
    plain = {name: _handoffs(name, staging, reference, repeat) for name in backends}

    # what serves: the programs prepared, as a node's background compile prepares them for its page buckets
    prepared = host_words.prepare(staging.shape, staging.dtype, staging.sharding)
    served_s, data = _median_seconds(fresh, lambda a: host_words.HostCopy(a).result().tobytes(), repeat)
    out["served"] = {"GBps": rate(served_s), "same_bytes": data == reference, "words": prepared,
                     "vs_as_is": round(as_is_s / served_s, 2)}
    up_served = [_time(lambda: host_words.to_device(host, staging.sharding)) for _ in range(repeat)]
    up_back = np.asarray(host_words.to_device(host, staging.sharding)).tobytes()
    out["up_served"] = {"GBps": rate(statistics.median(up_served)), "same_bytes": up_back == reference,
                        "vs_as_is": round(up_s / statistics.median(up_served), 2)}
    for name in backends:
        (plain_s, plain_same), (words_s, words_same) = plain[name], _handoffs(name, staging, reference, repeat)
        out[f"handoff_{name}_plain"] = {"GBps": rate(plain_s), "ms": round(plain_s * 1e3, 2), "same_bytes": plain_same}
        out[f"handoff_{name}_words"] = {"GBps": rate(words_s), "ms": round(words_s * 1e3, 2), "same_bytes": words_same,
                                        "vs_plain": round(plain_s / words_s, 2)}
    out["copies"] = dict(Counter(host_words.copies) - before)
    host_words.forget()
    return out


def _handoffs(name: str, staging, reference: bytes, repeat: int) -> tuple[float, bool]:
    """Median seconds of a handoff over backend ``name`` in this process (P publishes a fresh staging array, D pulls
    it over a unix socket until it is on the device), and whether every pulled array held the staging bytes."""
    spec = [jax.ShapeDtypeStruct(staging.shape, staging.dtype, sharding=staging.sharding)]
    with tempfile.TemporaryDirectory(prefix="host-copy-") as tmp, \
            create_backend(name, uds=f"{tmp}/p.sock") as p, create_backend(name, serve=False) as d:
        times, same = [], True
        for _ in range(repeat + 1):  # the first connects and warms the receive blocks: untimed
            fresh, uuid = jax.block_until_ready(staging + 0), new_uuid()
            start = time.perf_counter()
            p.publish(uuid, (fresh,), 60.0)
            (got,) = d.pull(p.address, uuid, spec, 60.0)
            jax.block_until_ready(got)
            times.append(time.perf_counter() - start)
            same = same and np.asarray(got).tobytes() == reference
            p.release(uuid)
        return statistics.median(times[1:]), same


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
    parser.add_argument("--backends", default="tcp,zmq",
                        help="handoffs over these backends, plain and as words ('' for none; default tcp,zmq)")
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
              "dtype": dtype, **measure(staging_array(model, args.mib), chunks=args.chunks, repeat=args.repeat,
                         backends=[b for b in args.backends.split(",") if b])}
    print(json.dumps(report), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0 if all(v.get("same_bytes", True) for v in report.values() if isinstance(v, dict)) else 1


if __name__ == "__main__":
    sys.exit(main())
