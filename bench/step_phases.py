"""Where a serving step's time goes, phase by phase, against this machine's roofline.

One run, on the model a user gets (SmolLM2 unless --model, float32, the default pool of 512 pages of 16):

1. the roofline: read bandwidth (a jitted sum over a 256 MB array) and matmul peak (a jitted 1024^3 float32 matmul),
   both on every core XLA uses here;
2. the compiled forward pass alone (``LoadedModel.decode`` / ``prefill_batch`` on the programs compiled ahead):
   decode at batch 1, 2, 4, 8 (every row at a context of --context tokens) and a single-prompt prefill at 16 to 512
   tokens; each against its roofline (weight bytes / bandwidth, and FLOPs / peak);
3. inside a decode step, each part jitted apart on the same shapes: the 30 layers' matmuls (QKV, O, gate/up, down,
   with norms and RoPE, no attention), the paged attention of 30 layers, the LM head, greedy sampling; and the host
   work around the program: the ``decode`` wrapper's checks and padding, and the call of a compiled program (what a
   forward split into several programs pays per program);
4. the first call of a compiled program (a 32-token prefill, decode at batch 2 and 4) against its next calls: a node
   compiles its programs ahead but runs each first on a request;
5. a colocated engine (the defaults) decoding 1, 2, 4, 8 streams: the decode loop's phases per step (forward,
   sample, emit: stop checks, detokenizing, streaming), the rest of its step, and the time between two steps.

Medians of --repeat runs; ratios are within this run. The machine is shared: read the load average it prints.

    python bench/step_phases.py [--model smollm2] [--repeat 15] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console
from rich.table import Table

from fsm_pd.model import decoder
from fsm_pd.model.attention import paged_attention
from fsm_pd.model.loader import load_model
from fsm_pd.model.rope import inverse_frequencies
from fsm_pd.model.sampling import SamplingParams, sample
from fsm_pd.runtime import compile_cache

PAGES, PAGE_SIZE = 512, 16
err = Console(stderr=True)


def median_ms(run, repeat: int, warm: int = 2) -> float:
    for _ in range(warm):
        run()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def roofline(repeat: int) -> dict:
    big = jnp.ones((64 << 20,), jnp.float32)  # 256 MB
    total = jax.jit(jnp.sum)
    read_ms = median_ms(lambda: total(big).block_until_ready(), repeat)
    a = jnp.ones((1024, 1024), jnp.float32)
    mm = jax.jit(jnp.matmul)
    mm_ms = median_ms(lambda: mm(a, a).block_until_ready(), repeat)
    return {"read_GBps": big.nbytes / read_ms / 1e6, "matmul_GFLOPs": 2 * 1024**3 / mm_ms / 1e6}


def weight_bytes(model) -> tuple[int, int]:
    """(bytes a decode step reads, of which the LM head's): every layer's weights, the head, not the embedding table
    beyond the rows it gathers (tied weights: the head is the embedding table, read once)."""
    layers = sum(x.nbytes for x in jax.tree.leaves(model.params["layers"]))
    head = model.params["embed"].nbytes if model.config.tie_word_embeddings else model.params["lm_head"].nbytes
    return layers + head, head


def first_runs(model, pool, shapes, repeat: int) -> tuple[dict, tuple]:
    """The first call of a compiled program against its next ones: a node compiles (or loads) its programs ahead
    and runs them first on a request. Each shape is compiled first, then called; nothing else in this process ran
    it before (run this before anything else)."""
    programs = model.programs(pool)
    out = {}
    for batch, tokens in shapes:
        programs.compile(batch, tokens)
        times = []
        for _ in range(1 + repeat):
            started = time.perf_counter()
            if tokens == 1:
                tables = [list(range(1 + 8 * r, 9 + 8 * r)) for r in range(batch)]
                logits, pool = model.decode(pool, [5] * batch, [40] * batch, tables, bucket_rows=True)
            else:
                result = model.prefill_batch(pool, [[7] * tokens] * batch,
                                             [list(range(1 + 8 * r, 9 + 8 * r)) for r in range(batch)],
                                             bucket_rows=True)
                logits, pool = result.logits, result.pool
            logits.block_until_ready()
            times.append((time.perf_counter() - started) * 1000)
        out[f"{'decode' if tokens == 1 else 'prefill'} {batch}x{tokens}"] = (times[0], statistics.median(times[1:]))
    return out, pool


def forward_costs(model, pool, context: int, batches, prompt_lengths, repeat: int) -> tuple[dict, dict, tuple]:
    pages_per_row = -(-(context + 2) // PAGE_SIZE)
    decode_ms = {}
    for batch in batches:
        tables = [list(range(1 + r * pages_per_row, 1 + (r + 1) * pages_per_row)) for r in range(batch)]
        state = {"pool": pool}

        def step(tables=tables, state=state, batch=batch):
            logits, state["pool"] = model.decode(state["pool"], [5] * batch, [context] * batch, tables,
                                                 bucket_rows=True)
            logits.block_until_ready()
        err.log(f"decode batch {batch}")
        decode_ms[batch] = median_ms(step, repeat)
        pool = state["pool"]
    prefill_ms = {}
    for length in prompt_lengths:
        state = {"pool": pool}
        pages = list(range(1, -(-length // PAGE_SIZE) + 1))

        def run(state=state, length=length, pages=pages):
            out = model.prefill_batch(state["pool"], [[7] * length], [pages], bucket_rows=True)
            state["pool"] = out.pool
            out.logits.block_until_ready()
        err.log(f"prefill {length}")
        prefill_ms[length] = median_ms(run, max(3, repeat // 3) if length >= 256 else repeat)
        pool = state["pool"]
    return decode_ms, prefill_ms, pool


def inside_decode(model, pool, context: int, batches, repeat: int) -> dict:
    """Each part of a decode step jitted apart, per batch: what the fused program spends where."""
    config, params = model.config, model.params
    inv_freq = jnp.asarray(inverse_frequencies(config))
    width = decoder.table_width(config, PAGES, PAGE_SIZE)
    pages_per_row = -(-(context + 2) // PAGE_SIZE)

    @jax.jit
    def matmuls(params, x, positions):
        for layer in params["layers"]:
            x, _ = decoder._decoder_layer(config, layer, x, positions, inv_freq, lambda q, k, v: (q, None))
        return x

    @partial(jax.jit, donate_argnames=("pools",))
    def attention(pools, q, k, v, tables, starts, lengths):
        out = []
        for layer_pool in pools:
            o, layer_pool = paged_attention(q, k, v, layer_pool, tables, starts, lengths)
            out.append(layer_pool)
            q = o
        return q, tuple(out)

    head = jax.jit(lambda params, h: decoder._logits(config, params, h))
    noop = jax.jit(lambda params, pool, tokens: tokens + 1)
    rows = {}
    for batch in batches:
        x = jnp.ones((batch, 1, config.hidden_size), jnp.float32)
        positions = jnp.full((batch, 1), context, jnp.int32)
        q = jnp.ones((batch, 1, config.num_heads, config.head_dim), jnp.float32)
        kv = jnp.ones((batch, 1, config.num_kv_heads, config.head_dim), jnp.float32)
        tables = np.zeros((batch, width), np.int32)
        for r in range(batch):
            tables[r, :pages_per_row] = np.arange(1 + r * pages_per_row, 1 + (r + 1) * pages_per_row)
        tables, starts = jnp.asarray(tables), jnp.full((batch,), context, jnp.int32)
        lengths = jnp.ones(batch, jnp.int32)
        state = {"pool": pool}

        def attend(state=state, q=q, kv=kv, tables=tables, starts=starts, lengths=lengths):
            out, state["pool"] = attention(state["pool"], q, kv, kv, tables, starts, lengths)
            out.block_until_ready()
        h = jnp.ones((batch, config.hidden_size), jnp.float32)
        logits = head(params, h)
        greedy = [SamplingParams(temperature=0)] * batch
        hot = [SamplingParams(temperature=0.7, top_p=0.9, seed=1)] * batch
        tokens = np.zeros((batch, 1), np.int32)
        host_tables = [list(range(1 + r * pages_per_row, 1 + (r + 1) * pages_per_row)) for r in range(batch)]
        err.log(f"phases at batch {batch}")
        rows[batch] = {
            "matmuls (30 layers, no attention)": median_ms(lambda x=x, p=positions: matmuls(params, x, p)
                                                           .block_until_ready(), repeat),
            "attention (30 layers, paged)": median_ms(attend, repeat),
            "LM head": median_ms(lambda h=h: head(params, h).block_until_ready(), repeat),
            "sampling, greedy": median_ms(lambda lg=logits, s=greedy, b=batch: sample(lg, s, [0] * b, [0] * b),
                                          repeat),
            "sampling, temperature + top-p": median_ms(lambda lg=logits, s=hot, b=batch: sample(
                lg, s, [1] * b, [0] * b), repeat),
            "host: decode() checks + padding": median_ms(lambda t=host_tables, b=batch: _host_part(model, t, b,
                                                                                                 context), repeat),
            "host: one compiled-program call (params + pool)": median_ms(
                lambda t=tokens, st=state: noop(params, st["pool"], t).block_until_ready(), repeat),
        }
        pool = state["pool"]
    return rows


def serving_step(model, batches, tokens: int) -> dict:
    """A colocated engine (defaults, warmed up) decoding ``batch`` greedy streams at once: ms per decode step in the
    decode loop's phases (forward = the program and the wait for it; sample; emit = stop checks, detokenizing,
    streaming), the step's wall time (what is left of it past the phases is the page tables, page growth and
    checks), and the time from one step's end to the next one's start (the step driver's requeue on the model
    thread, the scheduler's own prefill check)."""
    import asyncio

    from fsm_pd.serving.collect import generate
    from fsm_pd.serving.colocated_engine import ColocatedEngine
    from fsm_pd.serving.types import GenerateRequest
    from fsm_pd.serving.warmup import compile_rest, warm_up

    engine = ColocatedEngine(model)
    rows = {}
    try:
        warm_up(engine, progress=False)
        compile_rest(engine).join()
        for batch in batches:
            marks, step = [], engine.loop.step

            def timed(step=step, marks=marks):
                started = time.perf_counter()
                out = step()
                marks.append((started, time.perf_counter(), len(engine.loop.running)))
                return out
            engine.loop.step = timed
            before = dict(engine.loop.phase_seconds), engine.loop.steps
            requests = [GenerateRequest(f"s{batch}-{i}", [(i * 31 + j * 7) % 30000 + 100 for j in range(48)],
                                        SamplingParams(temperature=0, max_new_tokens=tokens, ignore_eos=True), seed=i)
                        for i in range(batch)]

            async def run(requests=requests):
                await asyncio.gather(*(generate(engine, r) for r in requests))
            err.log(f"serving {batch} streams")
            asyncio.run(run())
            engine.loop.step = step
            count = engine.loop.steps - before[1]  # means over every decode step (the batch fills and drains)
            phases = {k: (v - before[0][k]) * 1000 / count for k, v in engine.loop.phase_seconds.items()}
            wall = sum(b - a for a, b, _ in marks) * 1000 / count
            between = statistics.median([c - b for (_, b, _), (c, _, _) in zip(marks, marks[1:], strict=False)])
            rows[batch] = {**phases, "between two steps (median)": between * 1000, "step wall (mean)": wall}
    finally:
        engine.close()
    return rows


def _host_part(model, tables, batch: int, context: int) -> None:
    """What ``decoder.decode`` does on the host before the program: arrays, the page checks, the padding."""
    from fsm_pd.model import input_buckets
    tokens = np.asarray([5] * batch, np.int32)
    positions = np.asarray([context] * batch, np.int32)
    t = np.asarray(tables, np.int32)
    decoder._check_decode_tables(t, positions, PAGE_SIZE, PAGES)
    width = decoder.table_width(model.config, PAGES, PAGE_SIZE)
    b = input_buckets.batch_bucket(batch)
    input_buckets.pad_1d(tokens, b)
    input_buckets.pad_1d(positions, b)
    input_buckets.pad_1d(np.ones(batch), b)
    input_buckets.pad_2d(t[:, :width], b, width, fill=0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--context", type=int, default=96, help="tokens each decode row already holds (default 96)")
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--prompts", default="16,32,64,128,256,512")
    parser.add_argument("--tokens", type=int, default=48, help="new tokens per stream in the engine run (default 48)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    compile_cache.enable(compile_cache.default_dir())
    batches = [int(b) for b in args.batches.split(",")]
    prompts = [int(p) for p in args.prompts.split(",")]
    load = os.getloadavg()[0]
    model = load_model(args.model)
    pool = model.make_pool(model.make_kv_layout(PAGES, PAGE_SIZE))
    err.log("first runs")
    firsts, pool = first_runs(model, pool, [(1, 32), (2, 1), (4, 1)], max(3, args.repeat // 3))
    err.log("roofline")
    roof = roofline(args.repeat)
    nbytes, head_bytes = weight_bytes(model)
    params_count = sum(x.size for x in jax.tree.leaves(model.params["layers"])) + head_bytes // 4
    decode_ms, prefill_ms, pool = forward_costs(model, pool, args.context, batches, prompts, args.repeat)
    inside = inside_decode(model, pool, args.context, batches, args.repeat)
    serving = serving_step(model, batches, args.tokens)
    memory_ms = nbytes / roof["read_GBps"] / 1e6
    flops_ms = lambda tokens: 2 * params_count * tokens / roof["matmul_GFLOPs"] / 1e6
    report = {"model": args.model, "weight_MB": nbytes / 1e6, "head_MB": head_bytes / 1e6, **roof,
              "first_run_ms": firsts, "decode_ms": decode_ms, "prefill_ms": prefill_ms, "inside_decode_ms": inside,
              "serving_ms": serving,
              "load_average": [load, os.getloadavg()[0]]}
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    console = Console(width=140)
    console.print(f"roofline: read {roof['read_GBps']:.1f} GB/s, matmul {roof['matmul_GFLOPs']:.0f} GFLOP/s; "
                  f"a step reads {nbytes / 1e6:.0f} MB of weights ({head_bytes / 1e6:.0f} MB of it the LM head): "
                  f"{memory_ms:.1f} ms at the read bandwidth")
    for what, (first, then) in firsts.items():
        console.print(f"first run of a compiled program, {what}: {first:.0f} ms, then {then:.0f} ms")
    table = Table(title="the compiled forward pass alone, against its roofline")
    for column in ("step", "ms", "vs batch 1 / per token", "bytes bound ms", "FLOPs bound ms", "ms / max(bound)"):
        table.add_column(column, justify="right")
    for batch, ms in decode_ms.items():
        bound = max(memory_ms, flops_ms(batch))
        table.add_row(f"decode, batch {batch}", f"{ms:.1f}", f"{ms / decode_ms[batches[0]]:.2f}x",
                      f"{memory_ms:.1f}", f"{flops_ms(batch):.1f}", f"{ms / bound:.1f}x")
    for length, ms in prefill_ms.items():
        bound = max(memory_ms, flops_ms(length))
        table.add_row(f"prefill, {length} tokens", f"{ms:.1f}", f"{ms / length:.2f} ms/token", f"{memory_ms:.1f}",
                      f"{flops_ms(length):.1f}", f"{ms / bound:.1f}x")
    console.print(table)
    table = Table(title=f"inside a decode step (each part jitted apart; context {args.context} tokens), ms")
    table.add_column("part")
    for batch in batches:
        table.add_column(f"batch {batch}", justify="right")
    for part in next(iter(inside.values())):
        table.add_row(part, *(f"{inside[b][part]:.2f}" for b in batches))
    console.print(table)
    table = Table(title=f"a colocated engine decoding that many streams ({args.tokens} tokens each): ms per decode "
                        "step, by phase of the decode loop")
    table.add_column("phase")
    for batch in batches:
        table.add_column(f"batch {batch}", justify="right")
    for part in next(iter(serving.values())):
        table.add_row(part, *(f"{serving[b][part]:.2f}" for b in batches))
    console.print(table)
    console.print(f"1-min load average {load:.1f} before, {os.getloadavg()[0]:.1f} after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
