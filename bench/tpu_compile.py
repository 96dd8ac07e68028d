"""A node's forward programs compiled for a TPU v5e on this machine, no chip needed: each program's memory, the
layout XLA gives the pool, and how many whole pool layers each step copies.

    pip install --target /tmp/libtpu 'libtpu==0.0.42.*'    # the TPU compiler of jax 0.10.2 (about 700 MB)
    PYTHONPATH=$PYTHONPATH:/tmp/libtpu JAX_PLATFORMS=cpu TPU_ACCELERATOR_TYPE=v5litepod-1 \\
        TPU_WORKER_HOSTNAMES=localhost python bench/tpu_compile.py [--layers 13] [--head-dim 16] [--pages 64,4096]

libtpu compiles for a described chip without opening one (``jax.experimental.topologies``), so what XLA does to a
program on the chip (layouts, copies, memory) can be read on a CPU-only machine. The model is the tiny one
reshaped (``--layers``, ``--kv-heads``, ``--head-dim``), as ``tests/unit/test_step_cost.py`` builds it.

What it showed (docs/tpu.md, "The 13-layer pool temporary"): a pool layer ``[pages, page_size, row]`` whose row is not
a whole number of 128 lanes (the tiny model's 64) gets the page axis as its minor axis from 128 pages up
(``{0,2,1}``), and every step then copies each layer into row-major order and back.
"""

from __future__ import annotations

import argparse
import dataclasses
import re

import jax
import jax.numpy as jnp

from fsm_pd.model.params import random_params
from fsm_pd.model.programs import ForwardPrograms
from fsm_pd.model.tiny import tiny_model_parts


def programs_of(compiled) -> list[tuple[str, object]]:
    if hasattr(compiled, "program"):  # OneProgram: the whole model
        return [("whole", compiled.program)]
    groups = {f"group of {count}": group for _, count, group in compiled.groups}
    return [("embed", compiled.embed), *groups.items(), ("head", compiled.head)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=13)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--pages", default="64,4096", help="pool sizes, comma-separated")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--topology", default="v5e:1x1")
    args = parser.parse_args(argv)

    from jax.experimental import topologies

    chip = topologies.get_topology_desc(args.topology, "tpu", chips_per_host_bounds=(1, 1, 1)).devices[0]
    on_chip = jax.sharding.SingleDeviceSharding(chip)
    config, _, _ = tiny_model_parts(args.dtype)
    config = dataclasses.replace(config, num_layers=args.layers, num_kv_heads=args.kv_heads,
                                 num_heads=2 * args.kv_heads, head_dim=args.head_dim)
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on_chip),
                          random_params(config, seed=1, std=0.1))
    row = 2 * args.kv_heads * args.head_dim
    print(f"{chip.device_kind}: {args.layers} layers, pool rows of {row} {args.dtype}, batch {args.batch} x "
          f"{args.tokens} tokens")
    for pages in map(int, args.pages.split(",")):
        pool = tuple(jax.ShapeDtypeStruct((pages, 16, row), jnp.dtype(args.dtype), sharding=on_chip)
                     for _ in range(args.layers))
        compiled = ForwardPrograms(config, params, pool).compile(args.batch, args.tokens)
        for name, program in programs_of(compiled):
            memory, text = program.memory_analysis(), program.as_text()
            entry = re.search(r"entry_computation_layout=\{\((.*?)\)->", text).group(1)
            layouts = sorted(set(re.findall(rf"\[{pages},16,{row}\]\{{([^:}}]*)", entry)))
            copies = len(re.findall(rf"= \w+\[{pages},16,{row}\]\{{[^}}]*\}} copy\(", text))
            print(f"  {pages:6d} pages, {name:12s} temp {memory.temp_size_in_bytes / 2**20:7.2f} MiB, aliased "
                  f"{memory.alias_size_in_bytes / 2**20:8.2f} MiB, pool layout {','.join(layouts) or '-':7s} "
                  f"whole-layer copies {copies}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
