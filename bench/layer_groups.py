"""What the size of a forward pass's programs costs: compile, load from the compile cache, and step time.

A serving node runs a forward shape as programs of about ``LAYERS_PER_PROGRAM`` layers each, in turn
(``model/programs.py``). This compares, in one run, groups of 1, 3, 6 (the default), 10 layers and the whole model
in one program, on the model a user gets (SmolLM2 unless --model), the default pool (512 pages of 16 tokens), at
the shapes a node prepares first: a single-row decode step, a decode step of 8 rows, and a 512-token prefill.

For each: the seconds to compile the shape's programs with an empty compile cache, to load them again from the
cache (what a warm restart pays), and the median time of a call (the sizes take turns, round after round);
ratios against the whole-model program.

    python bench/layer_groups.py [--model smollm2] [--sizes 1,3,6,10,0] [--steps 8] [--rounds 5] [--json]

(``0`` in --sizes is the whole model in one program.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import jax
import numpy as np
from rich.console import Console
from rich.table import Table

from fsm_pd.model.loader import load_model
from fsm_pd.model.programs import ForwardPrograms
from fsm_pd.runtime import compile_cache

SHAPES = [(1, 1), (8, 1), (1, 512)]
PAGES, PAGE_SIZE = 512, 16


def call_args(programs: ForwardPrograms, shape) -> tuple:
    batch, tokens = shape
    context = 40  # positions already cached: a short chat's
    tables = np.zeros((batch, programs.width), np.int32)
    tables[:, : context // PAGE_SIZE + 2] = np.arange(1, context // PAGE_SIZE + 3)
    starts = np.full(batch, context if tokens == 1 else 0, np.int32)
    return np.ones((batch, tokens), np.int32), starts, np.full(batch, tokens, np.int32), tables


def prepare(model, size: int) -> tuple[dict, ForwardPrograms]:
    """Compile the shapes at ``size`` layers a program (0: the whole model), then load them again from the cache."""
    per_program = size or model.config.num_layers
    row = {"layers_per_program": per_program}
    pool = model.make_pool(model.make_kv_layout(PAGES, PAGE_SIZE))
    for phase in ("compile", "load"):
        jax.clear_caches()  # in-memory caches; the persistent one under cache_dir stays
        programs = ForwardPrograms(model.config, model.params, pool, layers_per_program=per_program)
        started = time.perf_counter()
        for shape in SHAPES:
            programs.compile(*shape)
        row[f"{phase}_s"] = time.perf_counter() - started
    row["calls"] = len(programs.groups) + 2
    return row, programs


def time_steps(model, prepared: list[tuple[dict, ForwardPrograms]], steps: int, rounds: int) -> None:
    """Median call time per size and shape, the sizes taking turns in ``rounds`` rounds (this machine's load
    drifts: a size timed in one block would carry the load of its minute), into each row."""
    pool = model.make_pool(model.make_kv_layout(PAGES, PAGE_SIZE))
    times: dict = {}
    for _ in range(rounds):
        for row, programs in prepared:
            for shape in SHAPES:
                program, args = programs.compile(*shape), call_args(programs, shape)
                logits, pool, _ = program(model.params, pool, *args)  # once untimed: caches warm for this size
                logits.block_until_ready()
                for _ in range(steps if shape[1] == 1 else max(2, steps // 5)):
                    started = time.perf_counter()
                    logits, pool, _ = program(model.params, pool, *args)
                    logits.block_until_ready()
                    times.setdefault((row["layers_per_program"], shape), []).append(time.perf_counter() - started)
    for row, _ in prepared:
        for shape in SHAPES:
            row[f"{shape[0]}x{shape[1]}_ms"] = statistics.median(times[(row["layers_per_program"], shape)]) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--sizes", default="1,3,6,10,0", help="layers per program to compare; 0: the whole model")
    parser.add_argument("--steps", type=int, default=8, help="calls timed per decode shape and round (prefill: a "
                        "fifth, at least 2)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds in which the sizes take turns (default 5)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    model = load_model(args.model)
    # One cache for the run (JAX sets its cache up once a process): each size's group programs are new to it; the
    # embedding and head programs, the same for every size, load from it after the first size.
    with tempfile.TemporaryDirectory(prefix="fsm-pd-groups-") as cache_dir:
        compile_cache.enable(cache_dir)
        prepared = [prepare(model, int(size)) for size in args.sizes.split(",")]
    time_steps(model, prepared, args.steps, args.rounds)
    rows = [row for row, _ in prepared]
    whole = next((r for r in rows if r["layers_per_program"] == model.config.num_layers), rows[-1])
    shapes = ", ".join(f"{b}x{t}" for b, t in SHAPES)
    table = Table(title=f"{args.model}, {model.config.num_layers} layers: shapes {shapes}")
    for column in ("layers a program", "calls a step", "compile s", "load s", *(f"{b}x{t} ms" for b, t in SHAPES)):
        table.add_column(column, justify="right")
    ratio = lambda row, key: f"{row[key]:.2f} ({row[key] / whole[key]:.2f}x)"
    for row in rows:
        table.add_row(str(row["layers_per_program"]), str(row["calls"]), ratio(row, "compile_s"), ratio(row, "load_s"),
                      *(ratio(row, f"{b}x{t}_ms") for b, t in SHAPES))
    Console().print(table)
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
