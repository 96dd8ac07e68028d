"""Producer (P) process for the transfer-backend tests and bench: a backend driven by JSON lines on stdin.

    python transfer_producer.py --backend zmq [--opts '{"chunk_bytes": 1048576}']

Prints ``{"address": ...}`` once ready, then answers one JSON line per command line:

    {"op": "publish", "seed": 1, "shapes": [[4, 8]], "dtypes": ["float32"], "hold_s": 30} -> {"uuid": ...}
    {"op": "publish_progressive", "seed": 1, "shape": [8, 1024], "dtype": "float32", "parts": 8, "pause_s": 0.1,
     "fill_parts": 8, "fail_after": null} -> {"uuid": ...}     # fills part by part on a thread, after replying
    {"op": "fail", "uuid": u, "reason": "..."}  {"op": "release", "uuid": u}  -> {"ok": true}
    {"op": "open"} -> {"count": n, "nbytes": b}          {"op": "exit"}
    {"op": "parked"} -> {"uuids": [...] or null}         # uuids pulls wait for, unpublished (null: cannot tell)
    {"op": "prepare_words", "shapes": [[2, 4, 16, 96]], "dtypes": ["bfloat16"], "down": true, "up": false}
        -> {"prepared": [bool, ...]}   # copy these arrays as 32-bit words (kernels/host_words.py), as on a TPU
    {"op": "copies"} -> {"copies": {"down_words": n, ...}}   # host_words.copies: how each copy went
    {"op": "pull", "address": a, "uuid": u, "seed": 1, "shapes": [[4, 8]], "dtypes": ["float32"], "timeout_s": 20}
        -> {"equal": bool}      # this process as the consumer: pulls and compares with make_arrays(seed, ...)

Payloads come from ``make_arrays(seed, shapes, dtypes)``, which the consumer imports to know the expected bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import numpy as np


def make_arrays(seed: int, shapes: list, dtypes: list) -> list[np.ndarray]:
    """Deterministic random bytes of each shape/dtype (any bit pattern, so NaNs are fine: compare bytes)."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    out = []
    for shape, dtype in zip(shapes, dtypes, strict=True):
        dtype = jnp.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        out.append(np.frombuffer(rng.bytes(nbytes), np.uint8).view(dtype).reshape(shape))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", required=True)
    parser.add_argument("--opts", default="{}")
    args = parser.parse_args()

    import jax

    from fsm_pd.transport.backends import create_backend, new_uuid

    backend = create_backend(args.backend, **json.loads(args.opts))
    reply({"address": backend.address})
    for line in sys.stdin:
        try:
            cmd = json.loads(line)
            op = cmd["op"]
            if op == "publish":
                staging = [jax.device_put(a) for a in make_arrays(cmd["seed"], cmd["shapes"], cmd["dtypes"])]
                jax.block_until_ready(staging)
                uuid = cmd.get("uuid") or new_uuid()
                backend.publish(uuid, staging, cmd.get("hold_s", 30.0))
                reply({"uuid": uuid})
            elif op == "publish_progressive":
                uuid = cmd.get("uuid") or new_uuid()
                fill_slowly(backend, uuid, cmd)
                reply({"uuid": uuid})
            elif op == "fail":
                backend.fail(cmd["uuid"], cmd["reason"])
                reply({"ok": True})
            elif op == "release":
                backend.release(cmd["uuid"])
                reply({"ok": True})
            elif op == "open":
                entries = backend.open_entries()
                reply({"count": entries.count, "nbytes": entries.nbytes})
            elif op == "parked":
                parked = backend.parked_pulls()
                reply({"uuids": None if parked is None else sorted(parked)})
            elif op == "prepare_words":
                from fsm_pd.kernels import host_words
                from fsm_pd.transport.backends.spec import default_sharding

                reply({"prepared": [host_words.prepare(shape, dtype, default_sharding(), down=cmd["down"], up=cmd["up"])
                                    for shape, dtype in zip(cmd["shapes"], cmd["dtypes"], strict=True)]})
            elif op == "copies":
                from fsm_pd.kernels import host_words

                reply({"copies": dict(host_words.copies)})
            elif op == "pull":
                want = make_arrays(cmd["seed"], cmd["shapes"], cmd["dtypes"])
                got = backend.pull(cmd["address"], cmd["uuid"], [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in want],
                                   cmd.get("timeout_s", 20.0))
                reply({"equal": all(np.asarray(g).tobytes() == w.tobytes() for g, w in zip(got, want, strict=True))})
            elif op == "exit":
                break
            else:
                reply({"error": f"unknown op {op!r}"})
        except Exception as exc:  # report, keep serving: the test decides what an error means
            reply({"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})
    backend.close()
    reply({"bye": True})
    # The backend is closed and the answer flushed: the interpreter's own teardown (joining threads, jax's exit
    # hooks) would only add up to a second to every producer a test stops.
    os._exit(0)


def fill_slowly(backend, uuid: int, cmd: dict) -> None:
    """Publish an empty host array, then make it final ``parts`` pieces at a time, ``pause_s`` apart (the first
    after one pause). Stops after ``fill_parts`` pieces; with ``fail_after``, fails the entry after that many."""
    import threading
    import time

    (expected,) = make_arrays(cmd["seed"], [cmd["shape"]], [cmd["dtype"]])
    host = np.zeros_like(expected)
    progress = backend.publish_progressive(uuid, host, cmd.get("hold_s", 30.0))
    src, dst = expected.reshape(-1).view(np.uint8), host.reshape(-1).view(np.uint8)
    parts = cmd["parts"]
    step = -(-src.size // parts)

    def fill() -> None:
        for part in range(cmd.get("fill_parts", parts)):
            if cmd.get("fail_after") == part:
                backend.fail(uuid, "gather failed on purpose")
                return
            time.sleep(cmd["pause_s"])
            end = min(src.size, (part + 1) * step)
            dst[part * step : end] = src[part * step : end]
            progress.advance(end)

    threading.Thread(target=fill, daemon=True).start()


def reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
