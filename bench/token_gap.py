"""What serving adds to the model: the gap between streamed tokens against the model's own decode step.

One run, on the model a user gets (SmolLM2 unless --model) with the defaults a user gets:

1. the model's own step: ``LoadedModel.decode`` at batch 1 in this process, on a pool of the default size and of
   4x it, after a prefill of the same prompt (median over --tokens steps);
2. the gap between tokens of one streamed ``/generate`` request at a time (--prompt-tokens in, --tokens out, greedy),
   median over --requests requests, through ``fsm-pd serve --role colocated`` at the default pool and at 4x it,
   and through 1 prefill + 1 decode behind the built-in router; each ratio is that gap over the model's step on
   the same pool size. Each server warms up first (its default); the programs it compiled after that are read off
   its ``/metrics`` (``fsm_pd_compiles_total{phase="serving"}``) and must be 0;
3. the decode loop's host work at batches --batches (default 8 and 32): a colocated engine in this process runs
   that many requests at once and reports ms per step in each phase (forward is the model; the rest is serving).

    python bench/token_gap.py [--model smollm2] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import Servers, serving_compiles  # noqa: E402 - beside this script

from fsm_pd.model.loader import load_model
from fsm_pd.model.sampling import SamplingParams
from fsm_pd.runtime import compile_cache
from fsm_pd.serving.collect import generate
from fsm_pd.serving.colocated_engine import ColocatedEngine
from fsm_pd.serving.types import GenerateRequest
from fsm_pd.serving.warmup import compile_rest, warm_up

DEFAULT_PAGES, PAGE_SIZE = 512, 16  # fsm-pd serve's defaults
err = Console(stderr=True)


def model_step_ms(model, num_pages: int, prompt: list[int], steps: int) -> float:
    pool = model.make_pool(model.make_kv_layout(num_pages, PAGE_SIZE))
    pages = list(range(1, -(-(len(prompt) + steps + 1) // PAGE_SIZE) + 1))
    out = model.prefill(pool, prompt, pages)
    pool, token, times = out.pool, int(out.logits.argmax()), []
    for i in range(steps + 3):
        started = time.perf_counter()
        logits, pool = model.decode(pool, [token], [len(prompt) + i], [pages])
        token = int(logits[0].argmax())
        times.append(time.perf_counter() - started)
    return statistics.median(times[3:]) * 1000


def stream_gaps_ms(url: str, prompt: list[int], tokens: int) -> list[float]:
    body = {"input_ids": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}
    arrivals = []
    with httpx.stream("POST", url + "/generate", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                arrivals.append(time.perf_counter())
    return [(b - a) * 1000 for a, b in zip(arrivals, arrivals[1:], strict=False)]


def phases_at(model, batch: int, prompt: list[int], tokens: int) -> dict:
    engine = ColocatedEngine(model)
    try:
        warm_up(engine, progress=False)
        compile_rest(engine).join()  # the steady state: every batch on its own program, not covered row by row

        async def run():
            requests = [GenerateRequest(f"b{i}", prompt, SamplingParams(temperature=0, max_new_tokens=tokens,
                                                                        ignore_eos=True), seed=i)
                        for i in range(batch)]
            await asyncio.gather(*(generate(engine, r) for r in requests))

        asyncio.run(run())
        counters = engine.loop.counters()
        steps = max(counters["decode_steps"], 1)
        return {phase: seconds * 1000 / steps for phase, seconds in counters["decode_phase_seconds"].items()}
    finally:
        engine.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompt-tokens", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per request (default 64)")
    parser.add_argument("--requests", type=int, default=5, help="streamed requests per server (default 5)")
    parser.add_argument("--batches", default="8,32", help="batch sizes for the phase breakdown (default 8,32)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    compile_cache.enable(compile_cache.default_dir())  # as a server does: this process warms up engines too
    model = load_model(args.model)
    prompt = [(i * 37) % 1000 + 100 for i in range(args.prompt_tokens)]
    report: dict = {"model": args.model, "prompt_tokens": args.prompt_tokens, "tokens": args.tokens,
                    "load_average_before": os.getloadavg()[0]}
    with err.status("the model's own step"):
        step = {pages: model_step_ms(model, pages, prompt, args.tokens) for pages in (DEFAULT_PAGES, 4 * DEFAULT_PAGES)}
    rows = [("the model's own decode step (batch 1)", f"{DEFAULT_PAGES} pages", step[DEFAULT_PAGES], 1.0, None),
            ("the model's own decode step (batch 1)", f"{4 * DEFAULT_PAGES} pages", step[4 * DEFAULT_PAGES], 1.0,
             None)]
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Servers(Path(tmp), args.model)
        try:
            setups = [("colocated server", DEFAULT_PAGES, lambda: cluster.serve("colocated")),
                      ("colocated server", 4 * DEFAULT_PAGES,
                       lambda: cluster.serve("colocated", "--num-pages", str(4 * DEFAULT_PAGES))),
                      ("1P1D behind the built-in router", DEFAULT_PAGES, lambda: cluster.router(*cluster.pd("tcp")))]
            for name, pages, start in setups:
                with err.status(f"starting {name}, {pages} pages (it warms up first)"):
                    url = start()
                gaps = []
                with err.status(f"{name}, {pages} pages: {args.requests} requests"):
                    for _ in range(args.requests):
                        gaps += stream_gaps_ms(url, prompt, args.tokens)
                nodes = [c.url for c in cluster.children if c.proc.poll() is None and not c.name.startswith("router")]
                late = sum(serving_compiles(u) for u in nodes[-2 if "1P1D" in name else -1:])
                gap = statistics.median(gaps)
                rows.append((name, f"{pages} pages", gap, gap / step[pages], late))
        finally:
            cluster.stop()
    phases = {}
    for batch in (int(b) for b in args.batches.split(",") if b):
        with err.status(f"decode phases at batch {batch}"):
            phases[batch] = phases_at(model, batch, prompt, args.tokens)
    report |= {"rows": [dict(what=w, pool=p, ms_per_token=g, vs_model_step=r, compiles_after_startup=c)
                        for w, p, g, r, c in rows],
               "decode_phase_ms_per_step": phases, "load_average_after": os.getloadavg()[0]}
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    table = Table(title=f"{args.model}: gap between tokens (median), {args.prompt_tokens} prompt tokens, "
                        f"{args.tokens} new, one request at a time")
    for column in ("what", "pool", "ms per token", "vs the model's step", "compiles after start-up"):
        table.add_column(column, justify="left" if column == "what" else "right")
    for what, pool, gap, ratio, late in rows:
        table.add_row(what, pool, f"{gap:.1f}", f"{ratio:.2f}x", "" if late is None else str(late))
    Console(width=120).print(table)
    table = Table(title="decode loop, ms per step by phase (forward is the model; the rest is what serving adds)")
    names = list(next(iter(phases.values()))) if phases else []
    for column in ("batch", *names, "serving share"):
        table.add_column(column, justify="right")
    for batch, row in phases.items():
        total = sum(row.values())
        table.add_row(str(batch), *(f"{row[n]:.2f}" for n in names),
                      f"{(total - row['forward']) / total:.1%}" if total else "n/a")
    Console(width=120).print(table)
    Console().print(f"1-min load average {report['load_average_before']:.1f} before, "
                    f"{report['load_average_after']:.1f} after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
