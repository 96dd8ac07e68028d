"""Decode attention alone, every layer of a model: the TPU kernel (``model/decode_attention.py``, the new K/V written
in the same call) against the jnp path (XLA's scatter, then ``attention.attend_pages``), in one run. One process.

    python bench/decode_attention.py [--models smollm2-135m,qwen3-1.7b-shape] [--page-sizes 16,64,128]
        [--batches 1,8,64] [--context 512] [--block-kib 512,2048] [--chunks 256,512] [--scattered] [--json out.json]

Per model shape, page size and batch: a pool of every layer holding ``batch`` rows of ``--context`` tokens (their
pages in order, or shuffled over the pool with ``--scattered``), one decode token per row; the step's attention
(all layers, one jitted program, the pool donated) timed as the median of 10 calls, against its roofline (the KV in
use read once at HBM bandwidth: 819 GB/s on a v5e) and against the jnp path's time. Each kernel setting
(``--block-kib``: KV bytes a block fetches; ``--chunks``: positions computed at a time) is checked against the jnp
path's output first (``max_err``, relative to the output's largest value). ``--quick``: small shapes (CI, on a CPU
in interpret mode).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from fsm_pd.model import attention, decode_attention

SHAPES = {  # heads, kv heads, head_dim, layers
    "smollm2-135m": (9, 3, 64, 30),
    "qwen3-1.7b-shape": (16, 8, 128, 28),
}
HBM = {"TPU v5 lite": 819e9, "TPU v5e": 819e9}


def timed(fn, repeat: int = 10) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def inputs(shape, page_size: int, batch: int, context: int, dtype, scattered: bool, seed: int = 0):
    heads, kv_heads, dim, layers = shape
    per_row = -(-(context + 1) // page_size)
    pages = 1 + batch * per_row
    rng = np.random.default_rng(seed)
    ids = 1 + (rng.permutation(pages - 1) if scattered else np.arange(pages - 1))
    tables = ids.reshape(batch, per_row).astype(np.int32)
    width = -(-per_row // 8) * 8
    tables = np.pad(tables, ((0, 0), (0, width - per_row)))
    lanes = 2 * kv_heads * dim
    key = jax.random.PRNGKey(seed)
    pool = tuple(jax.random.normal(jax.random.fold_in(key, i), (pages, page_size, lanes), dtype)
                 for i in range(layers))
    q = jax.random.normal(jax.random.fold_in(key, 1000), (batch, 1, heads, dim), dtype)
    kv = jax.random.normal(jax.random.fold_in(key, 1001), (2, batch, 1, kv_heads, dim), dtype)
    starts = jnp.full((batch,), context, jnp.int32)
    return pool, q, kv[0], kv[1], jnp.asarray(tables), starts, jnp.ones((batch,), jnp.int32)


def step_program(kernels: str, **settings):
    """All layers' attention as one program: each layer's pool written and attended, the outputs summed."""

    def run(pool, q, k, v, tables, starts, lengths):
        total, out_pool = jnp.zeros(q.shape, jnp.float32), []
        for layer in pool:
            if kernels == "jnp":
                out, layer = attention.paged_attention(q, k, v, layer, tables, starts, lengths, kernels="jnp")
            else:
                out, layer = decode_attention.decode_step(q, k, v, layer, tables, starts, lengths,
                                                          interpret=kernels == "interpret", **settings)
            total, out_pool = total + out.astype(jnp.float32), [*out_pool, layer]
        return total, tuple(out_pool)

    return jax.jit(run, donate_argnums=(0,))


def measure(name, page_size, batch, args, dtype, bandwidth, kernels):
    shape = SHAPES[name] if not args.quick else (9, 3, 64, 2)
    heads, kv_heads, dim, layers = shape
    pool, *rest = inputs(shape, page_size, batch, args.context, dtype, args.scattered)
    kv_bytes = layers * batch * (args.context + 1) * 2 * kv_heads * dim * jnp.dtype(dtype).itemsize
    roof = kv_bytes / bandwidth
    state = {"pool": pool}

    def call(program):
        out, state["pool"] = program(state["pool"], *rest)
        return out

    jnp_program = step_program("jnp")
    want = np.asarray(call(jnp_program), np.float32)
    jnp_s = timed(lambda: call(jnp_program), args.repeat)
    row = {"jnp_ms": round(1e3 * jnp_s, 4), "roofline_ms": round(1e3 * roof, 4),
           "jnp_share": round(roof / jnp_s, 3), "kernel": {}}
    lanes = 2 * kv_heads * dim
    for kib in args.block_kib:
        per_block = decode_attention.default_pages_per_block(page_size, lanes, jnp.dtype(dtype).itemsize, kib << 10)
        for chunk in args.chunks:
            label = f"{per_block}p/{chunk}t"
            if label in row["kernel"]:
                continue
            try:
                program = step_program(kernels, pages_per_block=per_block, chunk_tokens=chunk)
                # every call writes the same rows again, so the pool holds what the jnp path left there
                got = np.asarray(call(program), np.float32)
                seconds = timed(lambda program=program: call(program), args.repeat)
                err = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-9))
                row["kernel"][label] = {"ms": round(1e3 * seconds, 4), "share": round(roof / seconds, 3),
                                        "vs_jnp": round(jnp_s / seconds, 2), "max_err": round(err, 5)}
            except Exception as exc:  # noqa: BLE001 - one failed setting must not lose the others
                row["kernel"][label] = {"error": f"{type(exc).__name__}: {exc}"[:600]}
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(SHAPES))
    parser.add_argument("--page-sizes", default="16,64,128")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--block-kib", default=str(decode_attention.BLOCK_BYTES >> 10))
    parser.add_argument("--chunks", default=str(decode_attention.CHUNK_TOKENS))
    parser.add_argument("--scattered", action="store_true", help="each row's pages shuffled over the pool")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on an accelerator, float32 on a CPU")
    parser.add_argument("--quick", action="store_true", help="a 2-layer SmolLM2 shape, interpret mode off a TPU")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    dtype = args.dtype or ("float32" if device.platform == "cpu" else "bfloat16")
    kernels = "tpu" if device.platform == "tpu" else "interpret"
    if args.quick:
        args.models, args.page_sizes, args.batches, args.context, args.repeat = "smollm2-135m", "16", "2", 40, 2
    args.block_kib = [int(x) for x in args.block_kib.split(",")]
    args.chunks = [int(x) for x in args.chunks.split(",")]
    bandwidth = HBM.get(device.device_kind, 819e9)
    report = {"device": f"{device.platform}: {device.device_kind}", "dtype": dtype, "kernels": kernels,
              "scattered": args.scattered, "context": args.context, "figures": {}}
    print(json.dumps({k: v for k, v in report.items() if k != "figures"}), flush=True)
    os.environ.pop(attention.ATTENTION_ENV, None)
    for name in args.models.split(","):
        for page_size in (int(p) for p in args.page_sizes.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                try:
                    row = measure(name, page_size, batch, args, dtype, bandwidth, kernels)
                except Exception as exc:  # noqa: BLE001
                    row = {"error": f"{type(exc).__name__}: {exc}"[:600]}
                report["figures"][f"{name}/page{page_size}/batch{batch}"] = row
                print(name, f"page {page_size}", f"batch {batch}", json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
