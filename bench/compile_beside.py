"""A decode step while a background compile runs beside the model thread, at the interpreter's default turns of its
lock (5 ms) and in the brief turns the background compile takes (``runtime/switch_interval.py``).

A colocated engine (tiny unless --model) decodes --batch requests at once, --tokens each, greedy, in this process;
its decode loop's steps are timed (wall time over the steps it counts). Three ways, taking turns over --rounds:
alone; with a thread beside that traces and lowers programs without pause (what a background compile does, under the
lock) at the default turns; the same inside ``brief_turns``. Medians, and each against alone, same run.

    python bench/compile_beside.py [--model tiny] [--batch 8] [--tokens 64] [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import threading
import time

import jax
import jax.numpy as jnp

from fsm_pd.model.loader import load_model
from fsm_pd.model.sampling import SamplingParams
from fsm_pd.runtime.switch_interval import brief_turns
from fsm_pd.serving.collect import generate
from fsm_pd.serving.colocated_engine import ColocatedEngine
from fsm_pd.serving.types import GenerateRequest

WAYS = ("alone", "compiling beside, default turns", "compiling beside, brief turns")


def tracing(stop: threading.Event, brief: bool) -> None:
    """Trace and lower a new program after another until ``stop``: Python under the interpreter's lock."""
    n = 0
    with brief_turns() if brief else contextlib.nullcontext():
        while not stop.is_set():
            n += 1

            def program(x, n=n):
                for i in range(60):
                    x = jnp.sin(x) * (i + n) + jnp.cos(x)
                return x

            jax.jit(program).lower(jnp.zeros(8)).as_text()


def step_ms(engine, batch: int, tokens: int, tag: str) -> float:
    requests = [GenerateRequest(f"{tag}-{i}", [5 + i, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=tokens,
                                                                            ignore_eos=True), seed=i)
                for i in range(batch)]

    async def together():
        return await asyncio.gather(*(generate(engine, r) for r in requests))

    before = engine.loop.counters()["decode_steps"]
    started = time.perf_counter()
    asyncio.run(together())
    return (time.perf_counter() - started) / (engine.loop.counters()["decode_steps"] - before) * 1000


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    engine = ColocatedEngine(load_model(args.model), num_pages=128, page_size=16)
    load = [os.getloadavg()[0]]
    try:
        step_ms(engine, args.batch, args.tokens, "warm")  # this batch's programs compile here, not in the rounds
        times: dict[str, list[float]] = {way: [] for way in WAYS}
        for n in range(args.rounds):
            for way in WAYS:
                stop = threading.Event()
                beside = threading.Thread(target=tracing, args=(stop, way.endswith("brief turns")), daemon=True)
                if way != "alone":
                    beside.start()
                    time.sleep(0.2)
                try:
                    times[way].append(step_ms(engine, args.batch, args.tokens, f"{n}-{way}"))
                finally:
                    stop.set()
                    if beside.is_alive():
                        beside.join()
    finally:
        engine.close()
    load.append(os.getloadavg()[0])
    medians = {way: statistics.median(values) for way, values in times.items()}
    report = {"model": args.model, "batch": args.batch, "ms_per_step": times, "median_ms": medians,
              "vs_alone": {way: medians[way] / medians["alone"] for way in WAYS}, "load_average": load}
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"{args.model}, a decode step of {args.batch} rows, medians of {args.rounds} rounds "
          f"(load average {load[0]:.1f} before, {load[1]:.1f} after)\n")
    print("| way | ms a step | vs alone | rounds |\n| --- | ---: | ---: | --- |")
    for way in WAYS:
        print(f"| {way} | {medians[way]:.2f} | {report['vs_alone'][way]:.2f}x | "
              f"{', '.join(f'{v:.2f}' for v in times[way])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
