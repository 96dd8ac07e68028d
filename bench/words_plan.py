"""The host-words programs (``fsm_pd/kernels/host_words.py``) compiled for a TPU v5e on this machine, no chip needed:
for each staging shape, dtype and direction, the ops of libtpu's plan that read or write the float type (other than
the DMA kernel that changes its bits' type), the kernels, the temporaries and the bytes the plan touches. Exit status
1 where a 16-bit program has such an op: on the chip XLA's bitcast-convert of ``bfloat16`` quiets NaN payloads
(round r10), so any op that sees the 16-bit data as floats may change its bits.

    PYTHONPATH=$PWD:/path/to/libtpu-site python bench/words_plan.py [--shapes 3x1x16x64,30x256x16x384]
        [--dtypes bfloat16,float32] [--baseline] [--json PATH]

``--baseline``: beside the serving programs, the same programs with XLA's bitcast-convert in place of the DMA (what
served until round r10), to show in the same run what the plan of each looks like; its rows are shown, never failed
on. 1-D shapes are not compiled here (Pallas asks the local device, a CPU, for a 1-D block's tiling).
"""

from __future__ import annotations

import argparse
import json
import re
from contextlib import contextmanager
from unittest import mock

import compile_only  # noqa: F401  (bench/: before jax loads, a described chip's settings)
import jax
import jax.numpy as jnp
import numpy as np
from tpu_compile import chip_device  # (bench/: the described chip's one device)

from fsm_pd.kernels import host_words

FLOAT_TYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}  # HLO's names of the dtypes
MOVES_NOTHING = {"parameter", "bitcast", "get-tuple-element", "tuple", "fusion", "constant"}  # a fusion: its ops are
KERNEL = "tpu_custom_call"  # a Pallas kernel's custom-call target
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = \(?([a-z]+\d*)\[.*?\]\S* ([\w-]+)\((.*)$")


def float_ops(text: str, hlo_type: str) -> tuple[list[str], int]:
    """The plan's ops (fused ones too) with an operand or a result of ``hlo_type``, other than those that move
    nothing and the Pallas kernels, as ``op(operand types)->type``; and how many kernels see that type."""
    types, rows = {}, []
    for line in text.splitlines():
        found = _INSTRUCTION.match(line)
        if found:
            name, kind, op, rest = found.groups()
            types[name] = kind
            rows.append((kind, op, re.findall(r"%([\w.\-]+)", rest.split("),")[0]), KERNEL in rest))
    seen, kernels = set(), 0
    for kind, op, operands, kernel in rows:
        operand_types = sorted(types.get(o, "?") for o in operands)
        if op in MOVES_NOTHING or hlo_type not in (kind, *operand_types):
            continue
        if op == "custom-call" and kernel:
            kernels += 1
        else:
            seen.add(f"{op}({'/'.join(operand_types)})->{kind}")
    return sorted(seen), kernels


def programs(shape: tuple[int, ...], dtype: str, device) -> dict:
    placed = jax.sharding.SingleDeviceSharding(device)
    rows = int(np.prod(shape)) * np.dtype(dtype).itemsize // host_words.ROW_BYTES
    down = jax.jit(host_words.to_words).lower(jax.ShapeDtypeStruct(shape, dtype, sharding=placed))
    up = jax.jit(host_words.from_words, static_argnums=(1, 2)).lower(
        jax.ShapeDtypeStruct((rows, host_words.LANES), jnp.uint32, sharding=placed), shape, jnp.dtype(dtype))
    return {"down": down.compile(), "up": up.compile()}


def row(compiled, program: str, direction: str, shape, dtype: str) -> dict:
    ops, kernels = float_ops(compiled.as_text(), FLOAT_TYPES[dtype])
    costs = compiled.cost_analysis()
    costs = costs[0] if isinstance(costs, list) else costs
    return {"program": program, "direction": direction, "shape": list(shape), "dtype": dtype, "float_ops": ops,
            "kernels": kernels, "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
            "bytes_accessed": int(costs.get("bytes accessed", 0))}


@contextmanager
def xla_bitcast():
    """The programs as they were until round r10: XLA's bitcast-convert for every dtype."""
    jax.clear_caches()  # jit keeps each function's trace: trace them again, with the other same_bits
    with mock.patch.object(host_words, "same_bits", lambda x, dtype: jax.lax.bitcast_convert_type(x, dtype)):
        yield
    jax.clear_caches()


def problems(rows: list[dict]) -> list[str]:
    return [f"{r['direction']} {r['dtype']}{r['shape']}: {', '.join(r['float_ops'])}" for r in rows
            if r["program"] == "serving" and np.dtype(r["dtype"]).itemsize == 2 and r["float_ops"]]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="3x1x16x64,1x2x8x128,30x256x16x384",
                        help="staging shapes (the last: SmolLM2's 90 MiB), comma-separated")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--baseline", action="store_true", help="also XLA's bitcast-convert, as until round r10")
    parser.add_argument("--topology", default="v5e:1x1")
    parser.add_argument("--json", help="write the rows and problems here")
    args = parser.parse_args(argv)
    device = chip_device(args.topology)
    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
    rows = []
    for dtype in args.dtypes.split(","):
        for shape in shapes:
            for program, setting in (("serving", None), ("baseline", xla_bitcast))[:1 + args.baseline]:
                if setting is None:
                    compiled = programs(shape, dtype, device)
                else:
                    with setting():
                        compiled = programs(shape, dtype, device)
                rows += [row(compiled[d], program, d, shape, dtype) for d in ("down", "up")]
    print(f"{'program':9} {'dir':4} {'dtype':9} {'shape':18} {'temp MB':>8} {'touched MB':>10} kernels  float ops")
    for r in rows:
        print(f"{r['program']:9} {r['direction']:4} {r['dtype']:9} {'x'.join(map(str, r['shape'])):18} "
              f"{r['temp_bytes'] / 1e6:8.1f} {r['bytes_accessed'] / 1e6:10.1f} {r['kernels']:7}  "
              f"{', '.join(r['float_ops']) or '-'}")
    found = problems(rows)
    for line in found:
        print("problem: a 16-bit program reads or writes floats:", line)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"rows": rows, "problems": found}, out, indent=1)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
