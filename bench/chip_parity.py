"""Does the accelerator compute what the CPU computes? Greedy answers of random-weight models, device against CPU.

    python bench/chip_parity.py [--json out.json] [--prompts 16] [--steps 16] [--modes jnp,tpu] [--page-sizes 16,64]
                                [--steps-per-dispatch 8]

A CPU reference (a child process with ``JAX_PLATFORMS=cpu``, float32, each prompt prefilled whole and decoded alone)
gives, per prompt of 8 to 900 tokens, its greedy tokens and every step's logits. This process then runs the same
weights on its default device in --dtype (bfloat16 on an accelerator), as a node does: each longer prompt prefilled
in two chunks (the second starting at a page boundary: the path of a cached prefix or a chunked prefill), then all
rows decoded together as one ragged batch, fed the reference's tokens (teacher forcing, so each step sees the same
context on both sides), in pages of the device's default size (``--page-sizes``: others, each its own pool). Per
attention mode (``FSM_PD_ATTENTION``: jnp, and tpu: the TPU kernels, decode in ``model/decode_attention.py``; on a CPU
``interpret`` runs them in Pallas's interpret mode, ``tpu`` there is jnp), page size and step it reports:

- ``kernels``: the attention the model's programs really ran (``attention.kernels_for``): ``tpu`` asked of a model
  the kernels cannot take, or off a TPU, runs jnp, and says so here;

- ``agree``: the device's argmax is the reference's;
- ``near_tie``: it is not, but the reference's logits of the two tokens lie within bf16 rounding of the larger
  logit (``TIE_ULPS`` units of 2^-8 of its magnitude): either answer is right at this precision;
- ``differ``: a real disagreement;
- ``rel_err``: max |device - reference| over the vocabulary, over the reference's logit standard deviation
  (median and max over steps). bf16 arithmetic gives about 1e-2; a broken kernel gives about 1.

The multi-step path (``model/multi_step.py``, the decode loop's K steps a dispatch) runs too, per mode and page
size: the same
prompts prefilled the same way, the reference's first token fed, then every later token sampled greedily on the
device, --steps-per-dispatch steps a dispatch, all rows in each. It cannot be teacher-forced (the device feeds itself),
so each prompt is compared token by token up to its first split: ``agree`` counts the tokens equal to the
reference's, a split is a ``near_tie`` or a real ``differ`` by the same rule as above (the reference's logits at that
step), and the tokens after a split are ``unchecked`` (each side went on from its own token).

Models: SmolLM2-135M's shape (head_dim 64) and a Qwen3-1.7B-shaped one (head_dim 128) cut to --layers-1p7b layers,
so that the CPU reference stays quick; the kernels are per layer, so depth adds nothing to what is checked.
``--quick``: a small model of SmolLM2's head shape (9 heads, 3 KV heads of 64: the TPU kernels take it, where the tiny
model's head_dim 16 would run jnp whatever the mode), 2 layers, 3 prompts of up to 40 tokens (``--longest`` given:
that). On a CPU ``--quick --modes jnp,interpret --page-sizes 16,64,128 --longest 300`` checks the kernels at each
page size, prompts split into two chunks at 64 and 128 too (``tests/unit/test_bench_tpu.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

PAGE_SIZE = 16  # the CPU reference's
TIE_ULPS = 4


def shapes(layers_1p7b: int) -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    from tpu import SHAPES  # the bench of the chip's shapes: one definition

    return {"smollm2-135m": SHAPES["smollm2-135m"],
            "qwen3-1.7b-shape": {**SHAPES["qwen3-1.7b-shape"], "num_layers": layers_1p7b}}


# --quick's model: SmolLM2's heads (the TPU kernels' head_dim 64, K and V of a head in one 128-lane group), small
QUICK = {"quick-64": dict(vocab_size=272, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=9,
                          num_kv_heads=3, head_dim=64, tie_word_embeddings=True, max_position_embeddings=4096)}
QUICK_STD = 0.1  # weights as the tiny model's: logits far from uniform, so greedy answers are no coin toss on ties


def make_model(name: str, shape: dict, dtype: str):
    from fsm_pd.model.config import ModelConfig
    from fsm_pd.model.loader import LoadedModel
    from fsm_pd.model.params import random_params
    from fsm_pd.model.tokenizer import ByteTokenizer

    config = ModelConfig(dtype=dtype, eos_token_ids=(0,), rope_theta=10000.0, **{"family": "llama", **shape})
    std = QUICK_STD if name in QUICK else 0.02
    return LoadedModel(name, config, random_params(config, seed=0, std=std), ByteTokenizer(vocab_size=272))


def prompts_for(vocab: int, count: int, longest: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    lengths = np.linspace(8, longest, count).astype(int)
    return [rng.integers(1, min(vocab, 30000), size=int(n)).tolist() for n in lengths]


def reference(model, prompts, steps: int) -> tuple[list, list]:
    """Greedy tokens and logits of each prompt alone: whole prefill, then batch-1 decode steps."""
    pages_per = -(-(max(map(len, prompts)) + steps) // PAGE_SIZE)
    tokens_out, logits_out = [], []
    for prompt in prompts:
        pool = model.make_pool(model.make_kv_layout(pages_per + 1, PAGE_SIZE))
        table = np.arange(1, pages_per + 1, dtype=np.int32)
        result = model.prefill(pool, prompt, table[: -(-len(prompt) // PAGE_SIZE)].tolist())
        pool, rows = result.pool, [np.asarray(result.logits, np.float32)]
        tokens = [int(rows[0].argmax())]
        for step in range(steps - 1):
            logits, pool = model.decode(pool, np.array([tokens[-1]], np.int32),
                                        np.array([len(prompt) + step], np.int32), table[None, :])
            rows.append(np.asarray(logits, np.float32)[0])
            tokens.append(int(rows[-1].argmax()))
        tokens_out.append(tokens)
        logits_out.append(np.stack(rows))
    return tokens_out, logits_out


def on_device(model, prompts, ref_tokens: list, steps: int, page_size: int) -> tuple[list, str]:
    """Each step's logits on this process's default device, fed the reference's tokens: chunked prefill, then all
    rows decoded as one batch, in pages of ``page_size``; and the attention the programs ran."""
    pages_per = -(-(max(map(len, prompts)) + steps) // page_size)
    pool = model.make_pool(model.make_kv_layout(1 + pages_per * len(prompts), page_size))
    kernels = model.programs(pool).kernels
    tables = 1 + np.arange(pages_per * len(prompts), dtype=np.int32).reshape(len(prompts), pages_per)
    rows = [[] for _ in prompts]
    for i, prompt in enumerate(prompts):
        split = (len(prompt) // 2) // page_size * page_size
        if split:
            pool = model.prefill(pool, prompt[:split], tables[i, : split // page_size].tolist()).pool
        used = tables[i, : -(-len(prompt) // page_size)].tolist()
        result = model.prefill(pool, prompt[split:], used, start_pos=split)
        pool = result.pool
        rows[i].append(np.asarray(result.logits, np.float32))
    lengths = np.array([len(p) for p in prompts], np.int32)
    for step in range(steps - 1):
        tokens = np.array([t[step] for t in ref_tokens], np.int32)
        logits, pool = model.decode(pool, tokens, lengths + step, tables)
        logits = np.asarray(logits, np.float32)
        for i in range(len(prompts)):
            rows[i].append(logits[i])
    return [np.stack(r) for r in rows], kernels


def multi_step(model, prompts, ref_tokens: list, steps: int, per_dispatch: int,
               page_size: int) -> tuple[list[list[int]], str]:
    """Each prompt's greedy tokens from the multi-step program on this device: prefilled as ``on_device`` does, the
    reference's first token fed, then the rest sampled on the device, ``per_dispatch`` steps a dispatch, every row
    of the ragged batch in each dispatch, in pages of ``page_size``; and the attention the programs ran."""
    from fsm_pd.model.input_buckets import batch_bucket
    from fsm_pd.model.multi_step import StepRow, pack

    pages_per = -(-(max(map(len, prompts)) + steps) // page_size)
    pool = model.make_pool(model.make_kv_layout(1 + pages_per * len(prompts), page_size))
    kernels = model.programs(pool).kernels
    tables = 1 + np.arange(pages_per * len(prompts), dtype=np.int32).reshape(len(prompts), pages_per)
    for i, prompt in enumerate(prompts):
        split = (len(prompt) // 2) // page_size * page_size
        if split:
            pool = model.prefill(pool, prompt[:split], tables[i, : split // page_size].tolist()).pool
        pool = model.prefill(pool, prompt[split:], tables[i, : -(-len(prompt) // page_size)].tolist(),
                             start_pos=split).pool
    outs = [[tokens[0]] for tokens in ref_tokens]
    loops = model.programs(pool).steps
    while any(len(out) < steps for out in outs):
        rows = [StepRow(out[-1], len(prompt) + len(out) - 1, steps - len(out), tables[i].tolist())
                for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True))]
        packed = pack(rows, batch_bucket(len(rows)), loops.width_for(pages_per), per_dispatch, model.config.vocab_size)
        tokens, pool = loops.run(model.params, pool, packed, per_dispatch)
        for out, row in zip(outs, np.asarray(tokens), strict=False):
            out.extend(int(t) for t in row if t >= 0)
    return outs, kernels


def compare_tokens(ref_tokens: list, ref_logits: list, dev_tokens: list) -> dict:
    """Token by token up to each prompt's first split, classified by the reference's logits there."""
    agree = near = differ = unchecked = 0
    first_differ = []
    for prompt, (want, got, logits) in enumerate(zip(ref_tokens, dev_tokens, ref_logits, strict=True)):
        for step in range(1, len(want)):
            if got[step] == want[step]:
                agree += 1
                continue
            r = logits[step]
            if r[want[step]] - r[got[step]] <= TIE_ULPS * 2.0**-8 * abs(float(r[want[step]])):
                near += 1
            else:
                differ += 1
                first_differ.append({"prompt": prompt, "step": step,
                                     "gap": round(float(r[want[step]] - r[got[step]]), 4)})
            unchecked += len(want) - step - 1
            break
    return {"tokens": agree + near + differ + unchecked, "agree": agree, "near_tie": near, "differ": differ,
            "unchecked": unchecked, "first_differences": first_differ[:5]}


def compare(ref_logits: list, dev_logits: list) -> dict:
    agree = near = differ = 0
    errors, first_differ = [], []
    for prompt, (ref, dev) in enumerate(zip(ref_logits, dev_logits, strict=True)):
        for step, (r, d) in enumerate(zip(ref, dev, strict=True)):
            errors.append(float(np.abs(r - d).max() / max(float(r.std()), 1e-9)))
            want, got = int(r.argmax()), int(d.argmax())
            if want == got:
                agree += 1
            elif r[want] - r[got] <= TIE_ULPS * 2.0**-8 * abs(float(r[want])):
                near += 1
            else:
                differ += 1
                first_differ.append({"prompt": prompt, "step": step, "gap": round(float(r[want] - r[got]), 4)})
    return {"steps": agree + near + differ, "agree": agree, "near_tie": near, "differ": differ,
            "rel_err_median": round(statistics.median(errors), 4), "rel_err_max": round(max(errors), 4),
            "first_differences": first_differ[:5]}


def run_reference(args, path: Path) -> None:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("FSM_PD_ATTENTION", None)
    command = [sys.executable, __file__, "--reference-out", str(path), "--prompts", str(args.prompts),
               "--steps", str(args.steps), "--longest", str(args.longest), "--layers-1p7b", str(args.layers_1p7b),
               "--models", args.models] + (["--quick"] if args.quick else [])
    subprocess.run(command, env=env, check=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2-135m,qwen3-1.7b-shape")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--longest", type=int, default=None, help="the longest prompt, tokens (default 900; 40 "
                        "with --quick)")
    parser.add_argument("--steps", type=int, default=16, help="greedy tokens per prompt (default 16)")
    parser.add_argument("--layers-1p7b", type=int, default=4)
    parser.add_argument("--steps-per-dispatch", type=int, default=8, help="K of the multi-step path (default 8)")
    parser.add_argument("--modes", default="jnp,tpu", help="FSM_PD_ATTENTION values to run on the device")
    parser.add_argument("--page-sizes", default=None,
                        help="pages on the device, comma-separated (default: the device's default page size)")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on an accelerator, float32 on a CPU")
    parser.add_argument("--quick", action="store_true", help="a small head_dim-64 model, 3 short prompts (CI)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--reference-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.prompts, args.steps = next(iter(QUICK)), 3, 3
        args.longest = args.longest or 40
    args.longest = args.longest or 900
    models = dict(QUICK) if args.quick else {n: shapes(args.layers_1p7b)[n] for n in args.models.split(",")}
    if args.reference_out:  # the child: the CPU reference, float32
        out = {}
        for name, shape in models.items():
            model = make_model(name, shape, "float32")
            prompts = prompts_for(model.config.vocab_size, args.prompts, args.longest)
            tokens, logits = reference(model, prompts, args.steps)
            out[f"{name}/tokens"] = np.array(tokens, np.int32)
            for i, row in enumerate(logits):
                out[f"{name}/logits/{i}"] = row
        np.savez(args.reference_out, **out)
        return 0

    import jax

    device = jax.devices()[0]
    dtype = args.dtype or ("float32" if device.platform == "cpu" else "bfloat16")
    from fsm_pd.kernels.layout import default_page_size

    page_sizes = [int(p) for p in (args.page_sizes or str(default_page_size(device.platform))).split(",")]
    report = {"device": f"{device.platform}: {device.device_kind}", "dtype": dtype, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "reference.npz"
        run_reference(args, path)
        ref = np.load(path)
        for name, shape in models.items():
            tokens = ref[f"{name}/tokens"].tolist()
            ref_logits = [ref[f"{name}/logits/{i}"] for i in range(len(tokens))]
            report["models"][name] = {}
            for mode in args.modes.split(","):
                for page_size in page_sizes:
                    os.environ["FSM_PD_ATTENTION"] = mode
                    model = make_model(name, shape, dtype)  # new programs: the mode is read when they are made
                    prompts = prompts_for(model.config.vocab_size, args.prompts, args.longest)
                    try:
                        logits, kernels = on_device(model, prompts, tokens, args.steps, page_size)
                        figures = {"kernels": kernels, **compare(ref_logits, logits)}
                    except Exception as exc:  # noqa: BLE001 - one failed mode must not lose the others
                        figures = {"error": f"{type(exc).__name__}: {exc}"[:800]}
                    label = mode if len(page_sizes) == 1 else f"{mode}/page{page_size}"
                    report["models"][name][label] = figures
                    print(name, label, f"page {page_size}", json.dumps(figures), flush=True)
                    key = f"{label}/multi-step"
                    try:
                        dev_tokens, kernels = multi_step(model, prompts, tokens, args.steps, args.steps_per_dispatch,
                                                         page_size)
                        figures = {"kernels": kernels, **compare_tokens(tokens, ref_logits, dev_tokens)}
                    except Exception as exc:  # noqa: BLE001
                        figures = {"error": f"{type(exc).__name__}: {exc}"[:800]}
                    report["models"][name][key] = figures
                    print(name, key, f"page {page_size}", json.dumps(figures), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
