"""A step at a time against several steps a dispatch, under a decode-heavy load: where a token's time goes outside
the model's own step, while the node still compiles and once it is done.

For each K of --steps (default 1 and 8, the first is the baseline), round after round (--rounds, the Ks taking
turns), one ``fsm-pd serve --role colocated --decode-steps-per-dispatch K`` (tiny unless --model) on a unix socket,
through two phases:

- fresh 1, 2, ...: right after ``/health`` 200, --waves waves of --streams streamed chats at once (about 30 prompt
  tokens, 128 new, greedy, ``ignore_eos``), each a phase: what ``bench/load.py`` meets, the background compile still
  running;
- steady: once ``/server_info`` says the background compile is done, --waves waves together.

Per phase: output tok/s and TPOT p50 / p90 (the client's, as ``load.py`` times them), and from the node: the
programs it compiled meanwhile (background, serving), its decode steps and dispatches, the model's time a step as the
decode loop times it (``forward``: its calls and its waits on the device), the node's other time a step (the wall
time of the phase a step, less the model's: the scheduler, sampling, detokenizing, streaming, HTTP, the interpreter's
lock), and the process's CPU time a token (every thread: the model thread's host work, the event loop's, compiles).
Medians over rounds, and each K's ratio to the first K's, same run. The machine is shared: read the load averages.
``--baseline REF``: every K runs on the code of git revision REF (or of the checkout in directory REF) too, the
rounds taking turns, and the ratios are to REF's first K.

    python bench/dispatch_load.py [--model tiny] [--steps 1,8] [--rounds 2] [--waves 3] [--streams 16] [--no-steady]
                                [--baseline REF] [--run-dir DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
import load_client  # noqa: E402 - beside this script
import load_targets  # noqa: E402
from load_mixes import chat, percentile, request_body  # noqa: E402
from startup import checkout, python_path  # noqa: E402

from fsm_pd.net import unix_http

err = Console(stderr=True)
NEW_TOKENS, PROMPT_DIGITS = 128, 8  # a chat turn of about 30 tokens with the template and tag


def node_info(url: str) -> dict:
    with unix_http.client(timeout=30) as http:
        answer = http.get(url + "/server_info").json()
    return {**answer["internal_states"][0], "startup": answer.get("startup") or {}}


def cpu_seconds(pid: int) -> float:
    """The process's user and system CPU time so far (every thread)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_compiled(url: str, timeout_s: float) -> float:
    started = time.monotonic()
    while node_info(url)["startup"].get("background_compile", "running") == "running":
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"the background compile was not done within {timeout_s:.0f} s")
        time.sleep(0.5)
    return time.monotonic() - started


def phase(t: load_targets.Target, args, tag: int, waves: int) -> dict:
    """``waves`` waves of --streams chats at once; the client's figures and the node's counters over them."""
    info, compiled, cpu = node_info(t.url), load_targets.compiles(t.url), cpu_seconds(t.proc.pid)
    records, seconds = [], 0.0
    for wave in range(waves):
        base = tag + wave * 1000
        requests = [("short", request_body(chat(base + i, PROMPT_DIGITS, base + i), NEW_TOKENS))
                    for i in range(args.streams)]
        got, took = load_client.closed_loop(t.url, requests, args.streams, args.request_timeout)
        records += got
        seconds += took
    cpu = cpu_seconds(t.proc.pid) - cpu
    after, during = node_info(t.url), load_targets.compiled_since(compiled, load_targets.compiles(t.url))
    bad = [r for r in records if not r["ok"] or r["completion_tokens"] != NEW_TOKENS]
    if bad:
        raise RuntimeError(f"{len(bad)} answers not in full: {bad[0]}")
    tokens = sum(r["completion_tokens"] for r in records)
    steps = after["decode_steps"] - info["decode_steps"]
    forward = after["decode_phase_seconds"]["forward"] - info["decode_phase_seconds"]["forward"]
    tpot = [r["tpot_s"] for r in records]
    return {"tok_s": tokens / seconds, "ttft_p50_ms": percentile([r["ttft_s"] for r in records], 50) * 1000,
            "tpot_p50_ms": percentile(tpot, 50) * 1000,
            "tpot_p90_ms": percentile(tpot, 90) * 1000, "steps": steps,
            "dispatches": after["decode_dispatches"] - info["decode_dispatches"],
            "model_ms_per_step": forward / steps * 1000 if steps else None,
            "rest_ms_per_step": (seconds - forward) / steps * 1000 if steps else None,
            "cpu_ms_per_token": cpu / tokens * 1000,
            "compiled": {phase: n for phases in during.values() for phase, n in phases.items()}}


def run_node(k: int, args, run_dir: Path, tag: int, code: Path | None = None) -> dict:
    """``code``: a checkout whose fsm_pd the node runs (the baseline); None: this one."""
    t = load_targets.target("colocated", args.model, run_dir, node_args=(f"--decode-steps-per-dispatch={k}",
                                                                         *args.node_arg))
    load_targets.start(t, None if code is None else {**os.environ, "PYTHONPATH": python_path(code)})
    try:
        result = {"ready_s": load_targets.wait_health(t, args.ready_timeout)}
        for wave in range(args.waves):
            result[f"fresh {wave + 1}"] = phase(t, args, tag + wave * 1000, 1)
        if not args.no_steady:
            result["compiled_after_s"] = wait_compiled(t.url, args.ready_timeout)
            result["steady"] = phase(t, args, tag + 100_000, args.waves)
        return result
    finally:
        code = load_targets.stop(t)
        if code != 0:
            err.print(f"K={k}: the node exited with {code}:\n{t.log_tail()}")


def median(rounds: list[dict], where: str, key: str) -> float | None:
    values = [r[where][key] for r in rounds if r[where].get(key) is not None]
    return statistics.median(values) if values else None


def table(report: dict) -> str:
    base = report["labels"][0]
    lines = ["| K | phase | output tok/s | TTFT p50 (ms) | TPOT p50 / p90 (ms) | steps | dispatches | "
             "model ms / step | rest ms / step | CPU ms / token | compiled meanwhile (bg, serving) | "
             f"tok/s vs K={base} | TPOT p50 vs K={base} |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    phases = [*(f"fresh {w + 1}" for w in range(report["waves"])), *([] if report["no_steady"] else ["steady"])]
    for k in report["labels"]:
        rounds = report["runs"][k]
        for where in phases:
            m = {key: median(rounds, where, key) for key in ("tok_s", "ttft_p50_ms", "tpot_p50_ms", "tpot_p90_ms",
                                                             "steps",
                                                             "dispatches", "model_ms_per_step", "rest_ms_per_step",
                                                             "cpu_ms_per_token")}
            b = {key: median(report["runs"][base], where, key) for key in ("tok_s", "tpot_p50_ms")}
            compiled = [r[where]["compiled"] for r in rounds]
            bg = statistics.median(c.get("background", 0) for c in compiled)
            serving = max(c.get("serving", 0) for c in compiled)
            lines.append(f"| {k} | {where} | {fmt(m['tok_s'], '.0f')} | {fmt(m['ttft_p50_ms'], '.0f')} | "
                         f"{fmt(m['tpot_p50_ms'], '.1f')} / "
                         f"{fmt(m['tpot_p90_ms'], '.1f')} | {fmt(m['steps'], '.0f')} | {fmt(m['dispatches'], '.0f')} | "
                         f"{fmt(m['model_ms_per_step'], '.2f')} | {fmt(m['rest_ms_per_step'], '.2f')} | "
                         f"{fmt(m['cpu_ms_per_token'], '.3f')} | {bg:.0f}, {serving:.0f} | "
                         f"{m['tok_s'] / b['tok_s']:.2f}x | {m['tpot_p50_ms'] / b['tpot_p50_ms']:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", default="1,8", help="decode steps a dispatch to compare, the first the baseline")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--waves", type=int, default=3,
                        help="fresh waves of --streams chats, each a phase, then as many in the steady phase "
                             "(default 3)")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--no-steady", action="store_true",
                        help="the fresh waves only (a cold node's whole background compile takes minutes)")
    parser.add_argument("--node-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for every node, repeatable (--node-arg=--page-size=64)")
    parser.add_argument("--ready-timeout", type=float, default=900)
    parser.add_argument("--request-timeout", type=float, default=600)
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="where the sockets and the nodes' logs go (default: a temporary directory, removed)")
    parser.add_argument("--baseline", metavar="REF", default=None,
                        help="run every K on the code of git revision REF (or the checkout in directory REF) too")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    steps = [int(k) for k in args.steps.split(",") if k]
    with tempfile.TemporaryDirectory(prefix="fsm-pd-dispatch-") as scratch:
        codes = {**({args.baseline: checkout(args.baseline, Path(scratch))} if args.baseline else {}), "": None}
        runs = [(k, ref) for ref in codes for k in steps]  # the baseline's first: the ratios are to its first K
        label = lambda k, ref: f"{k} @{ref}" if ref else str(k)  # noqa: E731
        report = {"model": args.model, "steps": steps, "baseline": args.baseline, "streams": args.streams,
                  "waves": args.waves, "no_steady": args.no_steady, "labels": [label(k, ref) for k, ref in runs],
                  "new_tokens": NEW_TOKENS, "load_average_before": os.getloadavg()[0],
                  "runs": {label(k, ref): [] for k, ref in runs}}
        for n in range(args.rounds):
            for k, ref in runs:
                err.print(f"round {n + 1}/{args.rounds}: K={label(k, ref)}")
                run_dir = (args.run_dir or Path(scratch)) / f"k{k}{'-base' if ref else ''}-round{n + 1}"
                run_dir.mkdir(parents=True, exist_ok=True)
                result = run_node(k, args, run_dir.resolve(), 400_000 + n * 10_000, codes[ref])
                report["runs"][label(k, ref)].append(result)
                err.print({where: {key: round(v, 2) for key, v in figures.items() if isinstance(v, float)}
                           for where, figures in result.items() if isinstance(figures, dict)})
    report["load_average_after"] = os.getloadavg()[0]
    print(f"model {args.model}, colocated, {args.streams} streams: a wave is {args.streams} chats at once "
          f"({NEW_TOKENS} new tokens each); fresh: one wave a phase, right after ready; steady: {args.waves} waves "
          f"once the background compile is done; medians of {args.rounds} rounds\n")
    print(table(report))
    print(f"\n1-min load average {report['load_average_before']:.1f} before, {report['load_average_after']:.1f} "
          "after")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
