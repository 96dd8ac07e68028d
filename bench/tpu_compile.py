"""A node's pool programs compiled for a TPU v5e on this machine, no chip needed: for each program, its temporaries at a
small and a large pool, the layout XLA gives the pool, and how many whole pool layers it copies. Exit status 1 where
any program copies a layer, takes or returns the pool other than row-major, needs temporaries that grow with the
pool, or is refused by the compiler (the ``--role pd`` failure: "Ran out of memory on HBM").

    pip install --target /tmp/libtpu 'libtpu==0.0.42.*'    # the TPU compiler of jax 0.10.2 (about 700 MB)
    PYTHONPATH=$PYTHONPATH:/tmp/libtpu python bench/tpu_compile.py [--layers 13] [--pages 64,4096] [--shapes 8x1]
        [--pd [--hbm-gib 15.75]] [--baseline] [--json PATH]
    PYTHONPATH=$PYTHONPATH:/tmp/libtpu python bench/tpu_compile.py --trace-costs --smollm2   # start-up's Python side

libtpu compiles for a described chip without opening one (``jax.experimental.topologies``), so what XLA does to a
program on the chip (layouts, copies, memory) can be read on a CPU-only machine; the figures are the chip's own
(``tests/unit/test_step_cost.py`` measured 2,419,200 -> 3,225,600 B on the chip and here alike). The model is the
tiny one reshaped (``--layers``, ``--kv-heads``, ``--head-dim``), as ``test_step_cost.py`` builds it. The programs
are the serving code's: ``ForwardPrograms`` (each forward shape's embedding, groups of layers and head, or its one
program), the several-steps decode loop (``multi_step.StepPrograms``) and the page scatter a transfer lands with
(``page_copy.scatter_pages``'s jnp path: Pallas's needs rows of whole 128 lanes, which are row-major anyway).

``--pd``: the large pool is the one ``fsm-pd serve --role pd`` makes on a v5e with ``--hbm-gib`` free (the tiny model
in bfloat16, pages of 16, ``--kv-memory-fraction`` 0.8: ``pool_sizes.pool_budget`` at the bytes a page takes there,
``kernels/pool_format.page_bytes``). ``--baseline``: beside the serving programs, a group of layers compiled as it was
before the pool's layout was pinned (plain ``jax.jit``, the pool in XLA's default layout), to show what the pin saves
in the same run; its rows are shown, never failed on. Why the pin: ``fsm_pd/kernels/pool_format.py``, docs/tpu.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from collections.abc import Callable
from functools import partial

import compile_only  # noqa: F401  (bench/: before jax loads, a described chip's settings)
import jax
import jax.numpy as jnp

from fsm_pd.cli.pool_sizes import pool_budget
from fsm_pd.kernels import jnp_copy, pool_format
from fsm_pd.model import compiles
from fsm_pd.model.attention import ATTENTION_ENV, kernels_for
from fsm_pd.model.decoder import forward_group
from fsm_pd.model.params import random_params
from fsm_pd.model.programs import ForwardPrograms
from fsm_pd.model.tiny import tiny_model_parts

PAGE_SIZE = 16
KV_MEMORY_FRACTION = 0.8  # --role pd's default share of the free device memory for its pools
GROWTH_SHARE = 100  # temporaries may grow by at most 1/100 of a pool layer from the small pool to the large
STEPS = 4  # the decode loop's steps a dispatch


def chip_device(topology: str):
    """The one device of a described (compile-only) TPU: programs compile for it, nothing runs."""
    from jax.experimental import topologies

    return topologies.get_topology_desc(topology_name=topology, platform="tpu", chip_config_name="default",
                                        chips_per_host_bounds=(1, 1, 1), num_slices=1,
                                        wrap=(False, False, False)).devices[0]


def entry_layouts(text: str) -> tuple[str, str]:
    """The compiled module's parameter and result layouts: the text of its ``entry_computation_layout``, split."""
    at = text.index("entry_computation_layout={") + len("entry_computation_layout={")
    depth, end = 1, at
    while depth:
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        end += 1
    params, results = text[at:end - 1].split(")->", 1)
    return params, results


def layer_facts(compiled, layer_shape: tuple[int, ...]) -> dict:
    """What a compiled program does with pool layers of ``layer_shape``: their layouts as it takes and returns them
    (HLO minor-to-major: ``2,1,0`` is row-major); how many whole layers it copies (``copy`` or ``copy-start``, into
    HBM or VMEM, where ``memory_analysis`` counts no copy), and of those how many change the layout (``relayouts``:
    a small layer may be prefetched into VMEM as it is, but one copied into another order is the pool's price)."""
    text = compiled.as_text()
    shape = ",".join(map(str, layer_shape))
    array = rf"\w+\[{re.escape(shape)}\]\{{([\d,]*)"
    params, results = entry_layouts(text)
    layouts = {}  # instruction -> the minor-to-major order of its (first) array, where it is a pool layer
    copies = relayouts = 0
    for name, kind, op, operand in re.findall(r"%([\w.-]+) = (\(?[^ ]+)[^=]*? ([\w-]+)\(%?([\w.-]*)", text):
        found = re.match(r"\(?" + array, kind)
        if not found:
            continue
        layouts[name] = found.group(1)
        if op in ("copy", "copy-start"):
            copies += 1
            relayouts += layouts.get(operand, found.group(1)) != found.group(1)
    pool_layouts = lambda part: sorted(set(re.findall(array, part)))  # noqa: E731
    return {"layouts_in": pool_layouts(params), "layouts_out": pool_layouts(results), "layer_copies": copies,
            "relayouts": relayouts}


def serving_programs(config, params, pool, shapes) -> list[tuple[str, Callable]]:
    """(name, compile) of every program a node runs over ``pool`` (abstract) at ``shapes``: ``compile()`` returns
    [(name, compiled program)], the parts of a forward shape each under its own name."""
    forward = ForwardPrograms(config, params, pool)

    def forward_parts(batch: int, tokens: int) -> list[tuple[str, object]]:
        compiled, name = forward.compile(batch, tokens), f"forward {batch}x{tokens}"
        if hasattr(compiled, "program"):  # OneProgram: the whole model in one
            return [(name, compiled.program)]
        groups = {count: group for _, count, group in compiled.groups}
        return [(f"{name} embed", compiled.embed), *((f"{name} group of {n}", g) for n, g in groups.items()),
                (f"{name} head", compiled.head)]

    batch = max((batch for batch, tokens in shapes if tokens == 1), default=1)
    loop = f"decode loop {batch}x{STEPS}"
    rows = 8
    on = pool[0].sharding
    staging = jax.ShapeDtypeStruct((len(pool), rows, *pool[0].shape[1:]), pool[0].dtype, sharding=on)
    row_pages = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=on)
    scatter = f"page scatter {rows}"
    return [*((f"forward {b}x{t}", partial(forward_parts, b, t)) for b, t in shapes),
            (loop, lambda: [(loop, forward.steps.compile(batch, forward.steps.widths[0], STEPS))]),
            (scatter, lambda: [(scatter, jnp_copy.scatter_rows.lower(pool_format.abstract_pool(pool), staging,
                                                                     row_pages).compile())])]


def baseline_programs(config, params, pool, shapes) -> list[tuple[str, Callable]]:
    """A group of layers compiled as before the pin: plain ``jax.jit``, the pool in XLA's default layout."""
    plain = jax.jit(forward_group, static_argnames=("config", "kernels"), donate_argnames=("pools",))
    on = pool[0].sharding
    count, width = min(len(pool), 6), ForwardPrograms(config, params, pool).width
    ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=on)  # noqa: E731

    def group(batch: int, tokens: int, name: str) -> list[tuple[str, object]]:
        hidden = jax.ShapeDtypeStruct((batch, tokens, config.hidden_size), params["embed"].dtype, sharding=on)
        return [(name, plain.lower(params["layers"][:count], pool[:count], hidden, ints(batch), ints(batch),
                                   ints(batch, width), config=config, kernels="jnp").compile())]

    return [(name, partial(group, b, t, name))
            for b, t in shapes for name in [f"baseline {b}x{t} group of {count}"]]


def measure(named, layer_shape) -> list[dict]:
    rows = []
    for name, make in named:
        try:
            programs = make()
        except Exception as exc:  # noqa: BLE001  the compiler's refusal is a finding, reported as such
            rows.append({"program": name, "pages": layer_shape[0], "temp_bytes": None, "alias_bytes": None,
                         "layouts_in": [], "layouts_out": [], "layer_copies": None, "relayouts": None,
                         "error": str(exc).split("\n")[0][:200]})
            continue
        for part, compiled in programs:
            memory = compiled.memory_analysis()
            rows.append({"program": part, "pages": layer_shape[0], "temp_bytes": memory.temp_size_in_bytes,
                         "alias_bytes": memory.alias_size_in_bytes, **layer_facts(compiled, layer_shape),
                         "error": None})
    return rows


def problems(rows: list[dict], layer_bytes: int) -> list[str]:
    """Why the serving programs (not the baseline's) fail: refused, a layer copied, the pool not row-major, or
    temporaries grown from the small pool to the large by more than ``layer_bytes / GROWTH_SHARE``."""
    found, small = [], {}
    pages = sorted({row["pages"] for row in rows})
    for row in rows:
        if row["program"].startswith("baseline"):
            continue
        where = f"{row['program']} at {row['pages']} pages"
        if row["error"]:
            found.append(f"{where}: refused: {row['error']}")
            continue
        if row["relayouts"]:
            found.append(f"{where}: copies {row['relayouts']} whole pool layers into another layout")
        if set(row["layouts_in"] + row["layouts_out"]) - {"2,1,0"}:
            found.append(f"{where}: pool layout {row['layouts_in']} -> {row['layouts_out']}, not row-major")
        if row["pages"] == pages[0]:
            small[row["program"]] = row["temp_bytes"]
        elif small.get(row["program"]) is not None and row["temp_bytes"] - small[row["program"]] > \
                layer_bytes // GROWTH_SHARE:
            found.append(f"{where}: temporaries grew with the pool, {small[row['program']]} -> {row['temp_bytes']} B")
    return found


def program_kind(name: str) -> str:
    """``forward 8x1 ...`` is decode, ``forward 2x64 ...`` prefill; else the program's name without its shape."""
    if name.startswith("forward "):
        return "decode" if name.split()[1].endswith("x1") else "prefill"
    return name.rsplit(" ", 1)[0]


def trace_costs(config, params, pool, shapes, kernels: str) -> dict[str, compiles.KindCost]:
    """The serving programs compiled from cold (jax's caches cleared) with ``kernels``' attention: per kind, what
    tracing, lowering and the backend cost (``compiles``'s counters, the ones a node reports)."""
    os.environ[ATTENTION_ENV] = kernels
    print(f"{ATTENTION_ENV}={kernels}: the programs' attention is {kernels_for(pool, config.head_dim)}", flush=True)
    jax.clear_caches()
    compiles.install()
    before = compiles.costs()
    for name, make in serving_programs(config, params, pool, shapes):
        with compiles.preparing(program_kind(name)):
            make()
    spent = {}
    for kind, cost in compiles.costs().items():
        was = before.get(kind, compiles.KindCost())
        spent[kind] = compiles.KindCost(**{field: getattr(cost, field) - getattr(was, field) for field in vars(cost)})
    return {kind: cost for kind, cost in spent.items() if cost.programs}


def print_trace_costs(costs: dict[str, dict[str, compiles.KindCost]]) -> None:
    jnp_costs, tpu_costs = costs["jnp"], costs["tpu"]
    python = lambda cost: cost.trace_s + cost.lower_s  # noqa: E731
    print("seconds per kind of program; tpu/jnp: of trace + lower; backend: libtpu's compile on this CPU, jnp / tpu")
    print(f"{'kind':14s} {'programs':>8s}  {'jnp trace':>9s} {'lower':>6s}  {'tpu trace':>9s} {'lower':>6s}  "
          f"{'tpu/jnp':>7s}")
    for kind in sorted(set(jnp_costs) | set(tpu_costs)):
        j, t = jnp_costs.get(kind, compiles.KindCost()), tpu_costs.get(kind, compiles.KindCost())
        ratio = f"{python(t) / python(j):6.1f}x" if python(j) else "     -"
        print(f"{kind:14s} {t.programs:8d}  {j.trace_s:9.2f} {j.lower_s:6.2f}  {t.trace_s:9.2f} {t.lower_s:6.2f}  "
              f"{ratio}   backend {j.backend_s:.1f} / {t.backend_s:.1f}", flush=True)
    total = lambda kinds: sum(python(cost) for cost in kinds.values())  # noqa: E731
    print(f"all: jnp {total(jnp_costs):.2f} s, tpu {total(tpu_costs):.2f} s of tracing and lowering "
          f"({total(tpu_costs) / total(jnp_costs):.1f}x)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=13)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--dtype", default="float32", help="the model's and pool's (--pd: bfloat16, as on the chip)")
    parser.add_argument("--pages", default="64,4096", help="the small and the large pool, in pages")
    parser.add_argument("--shapes", default="1x1,8x1,2x64", help="forward shapes, BATCHxTOKENS, comma-separated")
    parser.add_argument("--pd", action="store_true", help="the large pool: --role pd's on a v5e (tiny, bfloat16)")
    parser.add_argument("--hbm-gib", type=float, default=15.75, help="--pd: the chip's free memory (GiB)")
    parser.add_argument("--baseline", action="store_true", help="also a group compiled in XLA's default layout")
    parser.add_argument("--heads", type=int, help="query heads (default: twice --kv-heads)")
    parser.add_argument("--smollm2", action="store_true",
                        help="SmolLM2-135M's shape: 30 layers, 9 heads, 3 KV heads of 64, bfloat16")
    parser.add_argument("--trace-costs", action="store_true",
                        help="print tracing and lowering seconds per kind, jnp attention against the TPU kernels")
    parser.add_argument("--topology", default="v5e:1x1")
    parser.add_argument("--json", help="write the rows and problems here")
    args = parser.parse_args(argv)
    if args.smollm2:
        args.layers, args.heads, args.kv_heads, args.head_dim, args.dtype = 30, 9, 3, 64, "bfloat16"

    chip = chip_device(args.topology)
    on_chip = jax.sharding.SingleDeviceSharding(chip)
    dtype = "bfloat16" if args.pd else args.dtype
    config, _, _ = tiny_model_parts(dtype)
    config = dataclasses.replace(config, num_layers=args.layers, num_kv_heads=args.kv_heads,
                                 num_heads=args.heads or 2 * args.kv_heads, head_dim=args.head_dim)
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on_chip),
                          random_params(config, seed=1, std=0.1))
    # from here on nothing runs: Pallas's Mosaic lowering reads the default device to know which TPU it compiles for
    jax.config.update("jax_default_device", chip)
    row_lanes = 2 * args.kv_heads * args.head_dim
    page_bytes = pool_format.page_bytes((PAGE_SIZE, row_lanes), dtype, on_chip)
    sizes = [int(n) for n in args.pages.split(",")]
    if args.pd:
        sizes[-1] = pool_budget(int(args.hbm_gib * 2**30), args.layers * page_bytes, KV_MEMORY_FRACTION)
    shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]
    print(f"{chip.device_kind}: {args.layers} layers, pool rows of {row_lanes} {dtype} ({page_bytes} B a page and "
          f"layer on the chip), pools of {' and '.join(map(str, sizes))} pages, shapes {args.shapes}", flush=True)

    if args.trace_costs:
        pool = tuple(jax.ShapeDtypeStruct((sizes[0], PAGE_SIZE, row_lanes), jnp.dtype(dtype), sharding=on_chip)
                     for _ in range(args.layers))
        print_trace_costs({kernels: trace_costs(config, params, pool, shapes, kernels) for kernels in ("jnp", "tpu")})
        return 0

    rows = []
    for pages in sizes:
        layer_shape = (pages, PAGE_SIZE, row_lanes)
        pool = tuple(jax.ShapeDtypeStruct(layer_shape, jnp.dtype(dtype), sharding=on_chip)
                     for _ in range(args.layers))
        named = serving_programs(config, params, pool, shapes)
        if args.baseline:
            named += baseline_programs(config, params, pool, shapes)
        for row in measure(named, layer_shape):
            rows.append(row)
            shown = (f"refused: {row['error']}" if row["error"] else
                     f"temp {row['temp_bytes'] / 2**20:8.2f} MiB, aliased {row['alias_bytes'] / 2**20:9.2f} MiB, "
                     f"pool {'/'.join(row['layouts_in']) or '-'} -> {'/'.join(row['layouts_out']) or '-'}, "
                     f"layer copies {row['layer_copies']} ({row['relayouts']} relayouts)")
            print(f"  {pages:8d} pages  {row['program']:32s} {shown}", flush=True)
    found = problems(rows, sizes[-1] * page_bytes)
    for line in found:
        print(f"problem: {line}")
    print("ok: no program holds anything the size of the pool" if not found else f"{len(found)} problems")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"rows": rows, "problems": found, "page_bytes": page_bytes, "pages": sizes}, out, indent=1)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
