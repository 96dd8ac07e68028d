"""How long running streams wait when a prompt joins them: a colocated node, before and after the step-time bound.

Issue 34 measured, on a colocated SmolLM2 node on 2 cores with 64-token streams, a token costing 3-5x its isolated
time as soon as a second stream joined: a joining 48-token prompt stalled the running streams ~0.4 s and a
480-token prompt 2 s, because a prefill step was bounded by tokens (``--chunked-prefill-size``, 512), not by time.
This bench replays its four cases on one colocated engine per setting, in this process, on the real model with the
defaults a user gets, and prints the median and the longest gap between two tokens of a running stream:

1. one stream (48-token prompt, 64 new tokens);
2. two streams, the second joining 0.3 s after the first;
3. four streams, joining 0.3 s apart;
4. one stream, and a 480-token prompt (16 new) arriving 0.5 s in: the gaps are the first stream's; the table also
   gives the long prompt's own time to first token, which the bound lengthens.

Settings: ``--prefill-chunk-steps 0`` (the old rule: a prefill step takes up to the chunked-prefill budget whatever is
running) and the default (``scheduling/step_budget.py``: while streams decode, a prefill step is cut to what fits in
that many ms). A token's time is when the engine pushed it (the model thread), so HTTP is not in the figures. Each
engine warms up and compiles every shape first, and the bench checks that nothing compiled while serving; one
unmeasured round of every case runs first on each engine (a compiled program's first run costs ~150 ms more, once:
``bench/step_phases.py``), and the settings take turns going first.

    python bench/join_stall.py [--model smollm2] [--settings 0,default] [--repeat 3] [--trace]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time

from rich.console import Console
from rich.table import Table

from fsm_pd.model import compiles
from fsm_pd.model.loader import load_model
from fsm_pd.model.sampling import SamplingParams
from fsm_pd.runtime import compile_cache
from fsm_pd.serving.colocated_engine import ColocatedEngine
from fsm_pd.serving.types import GenerateRequest, RequestStream
from fsm_pd.serving.warmup import compile_rest, warm_up

err = Console(stderr=True)
NEW_TOKENS = 64
CASES = {  # name: [(delay s, prompt tokens, new tokens, counted)]; counted streams' gaps make the figures
    "1 stream": [(0.0, 48, NEW_TOKENS, True)],
    "2 streams, the second 0.3 s later": [(0.0, 48, NEW_TOKENS, True), (0.3, 48, NEW_TOKENS, True)],
    "4 streams, 0.3 s apart": [(0.3 * i, 48, NEW_TOKENS, True) for i in range(4)],
    "1 stream, a 480-token prompt 0.5 s in": [(0.0, 48, NEW_TOKENS, True), (0.5, 480, 16, False)],
}


class TimedStream(RequestStream):
    """Records when the engine pushed each token."""

    def __init__(self, rid: str):
        super().__init__(rid)
        self.times: list[float] = []

    def push(self, item) -> None:
        self.times.append(time.perf_counter())
        super().push(item)


async def run_case(engine, plan, rng: random.Random, tag: str) -> tuple[list[list[float]], list[float]]:
    """The gaps of each counted stream, and the time to first token of each one not counted (the long prompt)."""
    async def one(i: int, delay: float, prompt: int, new: int) -> tuple[float, list[float]]:
        await asyncio.sleep(delay)
        ids = [rng.randrange(100, 40000) for _ in range(prompt)]  # fresh: the prefix cache must not serve it
        request = GenerateRequest(f"{tag}-{i}", ids, SamplingParams(temperature=0, max_new_tokens=new,
                                                                    ignore_eos=True), seed=i)
        stream = TimedStream(request.rid)
        submitted = time.perf_counter()
        engine.submit(request, stream)
        async for _ in stream:
            pass
        return submitted, stream.times

    runs = await asyncio.gather(*(one(i, d, p, n) for i, (d, p, n, _) in enumerate(plan)))
    gaps = [[(b - a) * 1000 for a, b in zip(t, t[1:], strict=False)]
            for (_, t), (*_, counted) in zip(runs, plan, strict=True) if counted]
    firsts = [(t[0] - submitted) * 1000 for (submitted, t), (*_, counted) in zip(runs, plan, strict=True)
              if not counted]
    return gaps, firsts


def trace_steps(engine) -> list:
    """Wrap the engine's prefill and decode step to log (start, seconds, what) for --trace."""
    log, prefill, decode = [], engine._prefill, engine.loop.step

    def timed(fn, what):
        def run():
            started = time.perf_counter()
            batch = len(engine.loop.running) if what == "decode" else len(engine._chunking) + len(engine._waiting)
            out = fn()
            log.append((started, time.perf_counter() - started, what, batch))
            return out
        return run
    engine._prefill, engine.loop.step = timed(prefill, "prefill"), timed(decode, "decode")
    return log


def start_engine(model, setting: str):
    kwargs = {} if setting == "default" else {"prefill_chunk_steps": float(setting)}
    engine = ColocatedEngine(model, **kwargs)
    warm_up(engine, progress=False)
    compile_rest(engine).join()
    return engine


def measure(model, settings: list[str], repeat: int, seed: int, trace: bool) -> dict:
    """Every case on one engine per setting, the settings taking turns run by run: a change in the machine's load
    falls on both."""
    engines = {}
    try:
        for setting in settings:
            err.log(f"warming up an engine for setting {setting}")
            engines[setting] = start_engine(model, setting)
        before = compiles.counts()["serving"]
        steps = {s: trace_steps(e) for s, e in engines.items()} if trace else {}
        rng = random.Random(seed)
        # a compiled program's first run costs ~150 ms more (step_phases.py), and the programs are shared by the
        # engines of one process: one unmeasured round of every case on every engine pays those first
        for setting, engine in engines.items():
            for name, plan in CASES.items():
                err.log(f"{setting}: {name}, unmeasured first round")
                asyncio.run(run_case(engine, plan, rng, f"{setting}-{name}-first"))
        gaps = {s: {name: [] for name in CASES} for s in settings}
        ttfts = {s: {name: [] for name in CASES} for s in settings}
        for name, plan in CASES.items():
            for r in range(repeat):
                order = list(engines.items())
                for setting, engine in order[r % 2:] + order[:r % 2]:  # each setting goes first in turn
                    err.log(f"{setting}: {name}, run {r + 1}")
                    case_gaps, firsts = asyncio.run(run_case(engine, plan, rng, f"{setting}-{name}-{r}"))
                    for stream_gaps in case_gaps:
                        gaps[setting][name] += stream_gaps
                    ttfts[setting][name] += firsts
                    if setting in steps:
                        long = [(round(t * 1000), w, b) for _, t, w, b in steps[setting] if t > 0.08]
                        err.log(f"steps over 80 ms: {long}")
                        steps[setting].clear()
        out = {s: {name: {"median_ms": statistics.median(g), "longest_ms": max(g), "gaps": len(g),
                          "joining_first_token_ms": statistics.median(ttfts[s][name]) if ttfts[s][name] else None}
                   for name, g in gaps[s].items()} for s in settings}
        for setting, engine in engines.items():
            out[setting]["bound"] = engine.budget.describe()
        out["serving_compiles"] = compiles.counts()["serving"] - before
        return out
    finally:
        for engine in engines.values():
            engine.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--settings", default="0,default",
                        help="--prefill-chunk-steps values to compare; 0: the old token-only rule (default 0,default)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each case per setting (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", action="store_true", help="log every step over 80 ms (stderr)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    compile_cache.enable(compile_cache.default_dir())
    compiles.install()
    model = load_model(args.model)
    load = os.getloadavg()[0]
    results = measure(model, args.settings.split(","), args.repeat, args.seed, args.trace)
    compiled = results.pop("serving_compiles")
    report = {"model": args.model, "results": results, "serving_compiles": compiled,
              "load_average": [load, os.getloadavg()[0]]}
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    table = Table(title=f"{args.model}, colocated, {NEW_TOKENS}-token streams: gaps between a running stream's tokens "
                        f"(ms; {args.repeat} runs per case)")
    table.add_column("case")
    for setting in results:
        label = "before (token budget only)" if setting == "0" else f"--prefill-chunk-steps {setting}"
        table.add_column(f"{label}: median / longest", justify="right")
    for name in CASES:
        table.add_row(name, *(f"{r[name]['median_ms']:.1f} / {r[name]['longest_ms']:.0f}" for r in results.values()))
    for name in CASES:
        if next(iter(results.values()))[name]["joining_first_token_ms"] is not None:
            table.add_row(f"({name}: its first token, median ms)",
                          *(f"{r[name]['joining_first_token_ms']:.0f}" for r in results.values()))
    Console(width=160).print(table)
    Console().print(f"programs compiled while serving: {compiled}")
    for setting, r in results.items():
        Console().print(f"{setting}: {r['bound']}")
    Console().print(f"1-min load average {load:.1f} before, {os.getloadavg()[0]:.1f} after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
