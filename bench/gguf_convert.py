"""A GGUF file's cold conversion, phase by phase: what a node's first start spends before it can compile and serve.

    python bench/gguf_convert.py [--model smollm2|FILE.gguf] [--dtype bfloat16] [--repeats 5] [--json]
    python bench/gguf_convert.py --against ../other-checkout   # the two in turn, run by run

Each repeat is a fresh process (imports already paid, the file in the page cache) that runs what ``load_gguf`` runs
on an empty cache: ``open`` (the header and metadata), ``config``, ``tokenizer``, ``params`` (dequantize and cast),
``save`` (the converted entry, into a temporary directory) and ``place`` (``jax.device_put`` of the host tree onto
JAX's first device, waited for: this machine's, so a CPU's copy, not a TPU's transfer). ``model`` (open + config +
tokenizer) is what a node waits for before it can build its engine and compile (``model/meanwhile.py``); ``weights``
(params + save + place) what it waits for after that. Figures are medians over the repeats; the machine's cores are
shared, so one run alone says little, and ``--against`` runs another checkout in turn with this one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PHASES = ("open", "config", "tokenizer", "params", "save", "place")


def one_conversion(model: str, dtype: str) -> dict[str, float]:
    """Seconds per phase of one conversion in this process."""
    import jax

    from fsm_pd.model import converted
    from fsm_pd.model.gguf_file import config_from_gguf, load_gguf_params, open_gguf
    from fsm_pd.model.gguf_tokenizer import tokenizer_from_gguf
    from fsm_pd.model.loader import gguf_source

    path, _ = gguf_source(model)
    jax.devices()  # the backend's start is no part of the conversion
    seconds, mark = {}, time.perf_counter()

    def lap(phase: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        seconds[phase], mark = now - mark, now

    reader = open_gguf(path)
    lap("open")
    config = config_from_gguf(reader, dtype=dtype, path=str(path))
    lap("config")
    tokenizer = tokenizer_from_gguf(reader, path=str(path))
    lap("tokenizer")
    params = load_gguf_params(reader, config, path=str(path))
    lap("params")
    with tempfile.TemporaryDirectory() as root:
        converted.save(converted.entry_dir(Path(root), path, dtype), config, params, tokenizer)
        lap("save")
    jax.block_until_ready(jax.device_put(params))
    lap("place")
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="a named model or a .gguf file")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--against", type=Path, metavar="CHECKOUT",
                        help="another checkout of fsm-pd, run in turn with this one (its fsm_pd first on the path)")
    parser.add_argument("--json", action="store_true", help="print the medians as JSON")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a repeat's own process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_conversion(args.model, args.dtype)))
        return 0
    checkouts = {"this": REPO, **({"against": args.against.resolve()} if args.against else {})}
    runs: dict[str, list] = {name: [] for name in checkouts}
    for _ in range(args.repeats):
        for name, code in checkouts.items():  # in turn, so that both see the machine's same moods
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(code), os.environ.get("PYTHONPATH")]))}
            out = subprocess.run([sys.executable, __file__, "--one", "--model", args.model, "--dtype", args.dtype],
                                 check=True, capture_output=True, text=True, cwd=code, env=env).stdout
            runs[name].append(json.loads(out.splitlines()[-1]))
    medians = {name: _medians(each) for name, each in runs.items()}
    if args.json:
        print(json.dumps({"model": args.model, "dtype": args.dtype, "repeats": args.repeats,
                          "checkouts": {name: str(code) for name, code in checkouts.items()},
                          "median_s": medians, "runs": runs}))
        return 0
    print(f"{args.model} -> {args.dtype}, medians of {args.repeats} runs (s):")
    print(f"  {'':<10}" + "".join(f"{name:>9}" for name in checkouts))
    for phase in medians["this"]:
        print(f"  {phase:<10}" + "".join(f"{medians[name][phase]:9.2f}" for name in checkouts))
    return 0


def _medians(runs: list[dict]) -> dict[str, float]:
    medians = {phase: statistics.median(run[phase] for run in runs) for phase in PHASES}
    medians["model"] = statistics.median(run["open"] + run["config"] + run["tokenizer"] for run in runs)
    medians["weights"] = statistics.median(run["params"] + run["save"] + run["place"] for run in runs)
    medians["total"] = statistics.median(sum(run[p] for p in PHASES) for run in runs)
    return medians


if __name__ == "__main__":
    sys.exit(main())
