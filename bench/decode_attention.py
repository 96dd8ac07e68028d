"""Decode attention alone, every layer of a model: the TPU kernel (``model/decode_attention.py``, the new K/V written
in the same call) against the jnp path (XLA's scatter, then ``attention.attend_pages``), in one run. One process.

    python bench/decode_attention.py [--models smollm2-135m,qwen3-1.7b-shape] [--page-sizes 16,64,128]
        [--batches 1,8,64] [--context 512] [--tails 128,1024] [--width 64] [--block-kib auto,512]
        [--chunks auto,256] [--scattered] [--json out.json]

Per model shape, page size, batch and layout: a pool of every layer holding ``batch`` rows of ``--context`` tokens
(``--tails T``: a second batch per T, its rows alternately ``--context`` and T tokens), their pages in order or
shuffled over the pool (``--scattered``), the page tables ``--width`` columns wide or the longest row's pages (to a
multiple of 8) where more, one decode token per row; the step's attention (all layers, one jitted program, the pool
donated) timed as the median of ``--repeat`` calls, against its roofline (the KV in use read once at HBM bandwidth:
819 GB/s on a v5e) and the jnp path's time. Each kernel setting (``--block-kib``: KV bytes a row's block fetches;
``--chunks``: positions computed at a time; ``auto``: ``decode_attention.block_settings``'s) is checked against the
jnp path's output first (``max_err``, relative to the output's largest value). A table on stdout, every figure in
``--json``. ``--quick``: small shapes (CI, on a CPU in interpret mode).
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
COLUMNS = ("case", "setting", "ms", "us/layer", "share", "vs_jnp", "max_err")


def timed(fn, repeat: int = 10) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def inputs(shape, page_size: int, contexts: list[int], width: int | None, dtype, scattered: bool, seed: int = 0):
    """Every layer's pool and a step's inputs for rows of ``contexts`` tokens (plus the new one each)."""
    heads, kv_heads, dim, layers = shape
    per_row = [-(-(context + 1) // page_size) for context in contexts]
    pages = 1 + sum(per_row)
    rng = np.random.default_rng(seed)
    ids = 1 + (rng.permutation(pages - 1) if scattered else np.arange(pages - 1))
    width = max(width or 0, -(-max(per_row) // 8) * 8)  # --width at least: a longer row widens the table
    tables = np.zeros((len(contexts), width), np.int32)
    for row, (first, n) in enumerate(zip(np.cumsum([0, *per_row[:-1]]), per_row, strict=True)):
        tables[row, :n] = ids[first:first + n]
    lanes = 2 * kv_heads * dim
    key = jax.random.PRNGKey(seed)
    pool = tuple(jax.random.normal(jax.random.fold_in(key, i), (pages, page_size, lanes), dtype)
                 for i in range(layers))
    batch = len(contexts)
    q = jax.random.normal(jax.random.fold_in(key, 1000), (batch, 1, heads, dim), dtype)
    kv = jax.random.normal(jax.random.fold_in(key, 1001), (2, batch, 1, kv_heads, dim), dtype)
    starts = jnp.asarray(contexts, jnp.int32)
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


def settings_of(args, page_size: int, lanes: int, itemsize: int, width: int):
    """``(label, decode_step's settings)`` for each kernel setting asked for."""
    for kib in args.block_kib:
        for chunk in args.chunks:
            per_block = None if kib is None else decode_attention.default_pages_per_block(
                page_size, lanes, itemsize, kib << 10)
            per_block, chunk_pages = decode_attention.block_settings(page_size, lanes, itemsize, width, per_block,
                                                                     chunk)
            yield (f"{per_block}p/{chunk_pages * page_size}t",
                   {"pages_per_block": per_block, "chunk_tokens": chunk_pages * page_size})


def measure(name, page_size, contexts, args, dtype, bandwidth, kernels):
    shape = SHAPES[name] if not args.quick else (9, 3, 64, 2)
    heads, kv_heads, dim, layers = shape
    pool, *rest = inputs(shape, page_size, contexts, args.width, dtype, args.scattered)
    lanes, itemsize = 2 * kv_heads * dim, jnp.dtype(dtype).itemsize
    kv_bytes = layers * sum(context + 1 for context in contexts) * lanes * itemsize
    roof = kv_bytes / bandwidth
    state = {"pool": pool}

    def call(program):
        out, state["pool"] = program(state["pool"], *rest)
        return out

    jnp_program = step_program("jnp")
    want = np.asarray(call(jnp_program), np.float32)
    jnp_s = timed(lambda: call(jnp_program), args.repeat)
    row = {"layers": layers, "width": int(rest[3].shape[1]), "roofline_ms": round(1e3 * roof, 4),
           "jnp_ms": round(1e3 * jnp_s, 4), "jnp_share": float(f"{roof / jnp_s:.3g}"), "kernel": {}}
    for label, settings in settings_of(args, page_size, lanes, itemsize, rest[3].shape[1]):
        if label in row["kernel"]:  # two arguments that come to the same setting: timed once
            continue
        try:
            program = step_program(kernels, **settings)
            # every call writes the same rows again, so the pool holds what the jnp path left there
            got = np.asarray(call(program), np.float32)
            seconds = timed(lambda program=program: call(program), args.repeat)
            err = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-9))
            row["kernel"][label] = {
                "ms": round(1e3 * seconds, 4), "us_per_layer": round(1e6 * seconds / layers, 2),
                "share": float(f"{roof / seconds:.3g}"), "vs_jnp": round(jnp_s / seconds, 2),
                "max_err": float(f"{err:.2e}")}
        except Exception as exc:  # noqa: BLE001 - one failed setting must not lose the others
            row["kernel"][label] = {"error": f"{type(exc).__name__}: {exc}"[:600]}
    return row


def table_lines(case: str, row: dict) -> list[str]:
    """``row`` (``measure``'s) as lines of the table: the jnp path's, then each kernel setting's."""
    if "error" in row:
        return [f"{case:<40} error: {row['error']}"]
    layers = row["layers"]
    lines = [f"{case:<40} {'jnp':<16} {row['jnp_ms']:>9.3f} {1e3 * row['jnp_ms'] / layers:>9.1f} "
             f"{row['jnp_share']:>6.3g} {'':>7} {'':>8}  (roofline {row['roofline_ms']:.3f} ms)"]
    for label, fig in row["kernel"].items():
        if "error" in fig:
            lines.append(f"{case:<40} {label:<16} error: {fig['error'][:200]}")
            continue
        lines.append(f"{case:<40} {label:<16} {fig['ms']:>9.3f} {fig['us_per_layer']:>9.1f} {fig['share']:>6.3g} "
                     f"{fig['vs_jnp']:>7.2f} {fig['max_err']:>8.1e}")
    return lines


def numbers(text: str, auto: bool = False) -> list:
    return [None if auto and x == "auto" else int(x) for x in text.split(",")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(SHAPES))
    parser.add_argument("--page-sizes", default="16,64,128")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--tails", default="", help="T,...: a batch per T, its rows alternately --context and T")
    parser.add_argument("--width", type=int, default=None, help="page-table columns, at least")
    parser.add_argument("--block-kib", default="auto", help="KiB a row's block fetches, or auto")
    parser.add_argument("--chunks", default="auto", help="positions computed at a time, or auto")
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
        args.models, args.page_sizes, args.batches, args.context, args.repeat = "smollm2-135m", "16", "3", 40, 2
        args.tails = args.tails and "10"
    args.block_kib, args.chunks = numbers(args.block_kib, auto=True), numbers(args.chunks, auto=True)
    bandwidth = HBM.get(device.device_kind, 819e9)
    report = {"device": f"{device.platform}: {device.device_kind}", "dtype": dtype, "kernels": kernels,
              "scattered": args.scattered, "context": args.context, "tails": args.tails, "width": args.width,
              "figures": {}}
    print(json.dumps({k: v for k, v in report.items() if k != "figures"}), flush=True)
    print(f"{COLUMNS[0]:<40} {COLUMNS[1]:<16} {COLUMNS[2]:>9} {COLUMNS[3]:>9} {COLUMNS[4]:>6} {COLUMNS[5]:>7} "
          f"{COLUMNS[6]:>8}", flush=True)
    os.environ.pop(attention.ATTENTION_ENV, None)
    layouts = [[args.context]] + [[args.context, tail] for tail in (numbers(args.tails) if args.tails else [])]
    for name in args.models.split(","):
        for page_size in numbers(args.page_sizes):
            for batch in numbers(args.batches):
                for layout in layouts:
                    contexts = [layout[row % len(layout)] for row in range(batch)]
                    case = f"{name}/page{page_size}/batch{batch}/ctx{'+'.join(map(str, layout))}"
                    try:
                        row = measure(name, page_size, contexts, args, dtype, bandwidth, kernels)
                    except Exception as exc:  # noqa: BLE001
                        row = {"error": f"{type(exc).__name__}: {exc}"[:600]}
                    report["figures"][case] = row
                    print("\n".join(table_lines(case, row)), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
