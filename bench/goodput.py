"""Does PD pay for itself? Goodput under an SLO (DistServe's method), PD against colocated on the same cores.

Both run the model a user gets (SmolLM2 unless --model) with default flags, behind the built-in router for PD:

- PD: the prefill node pinned to core 0 and the decode node to core 1 (``taskset``), the router on both;
- colocated: one node pinned to cores 0 and 1 together;
- PD with the policy (``pd-policy``; --modes picks the setups): the same pinned nodes behind a second router,
  ``--pd-policy auto --prefill-serves-local``, the prefill node started with ``--serve-local`` (it serves both roles:
  ``docs/serving.md``, "Selective disaggregation"). The classic router never sends it a request whole.

Workloads (one run does all four): ``prefill-heavy`` (prompts of about --long-prompt tokens, --short-output new
tokens), ``decode-heavy`` (prompts of about --short-prompt, --long-output new), ``mixed`` (30% long prompts, the rest
short; --mixed-output new), ``shift`` (the mix changes halfway: prefill-heavy requests, then decode-heavy ones; each
half is held to its own kind's SLO, and each mode prints where its requests went over time: through P and D, whole
on the decode node, whole on the prefill node). Greedy, EOS ignored, streamed ``/generate`` requests with Poisson
arrivals.

The SLO comes from isolated latencies: one request at a time on the colocated node, medians; a request attains the
SLO when its TTFT <= --ttft-scale x the isolated TTFT and its time per output token (after the first) <=
--tpot-scale x the isolated one. ``--slo-from`` holds a run to the SLO an earlier one derived instead
(``bench/slo/smollm2-2core.json``), so that two runs' goodputs compare. Goodput is the highest rate of --rates with
>= 90% attainment, found by a walk over them (``goodput_search.find_goodput``); a run at a rate sends --requests
requests, more where they would arrive in under --min-seconds. The table prints attainment per
rate, goodput per mode and the PD / colocated ratio, and each mode's TTFT phases at the goodput rate (queueing and
prefill on the prefill node, the KV transfer, the decode node's queue).

    python bench/goodput.py [--model smollm2] [--requests 24] [--json]

``--sweep`` measures the crossover instead (``crossover.py``): goodput over a grid of prompt lengths (--prompts,
default 64,256,1024,2048) and output lengths (--outputs, default 16,128) for colocated, PD with every request through
the prefill node (``--pd-policy always``) and PD with the selective policy (``--pd-policy auto``), each rate sweep
--repeat times, and writes the table and plot into --docs-dir (docs/crossover.md, docs/crossover.png):

    python bench/goodput.py --sweep [--requests 24] [--repeat 2] [--docs-dir docs]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from goodput_search import capacity_over_time, find_goodput, phases, requests_at, stream  # noqa: E402
from serving import Servers, serving_compiles  # noqa: E402 - beside this script

from fsm_pd.cli.launch import free_port
from fsm_pd.model.loader import load_model

err = Console(stderr=True)
WORKLOADS = ("prefill-heavy", "decode-heavy", "mixed", "shift")
MODES = ("colocated", "pd", "pd-policy")
DEFAULT_RATES = "0.1,0.15,0.2,0.25,0.3,0.4,0.5,0.6,0.75,0.9,1,1.25,1.5,2,2.5,3,4"  # ~1.25x apart


def workload(name: str, args, rng: random.Random, vocab: int, count: int | None = None
             ) -> list[tuple[list[int], int]]:
    """(prompt token ids, new tokens) of ``count`` requests (default --requests); ids drawn from the model's
    vocabulary, past its first tenth (special and byte tokens)."""
    count = count or args.requests

    def prompt(n: int) -> list[int]:
        n = max(4, int(rng.gauss(n, n / 10)))
        return [rng.randrange(vocab // 10, vocab) for _ in range(n)]

    if name == "prefill-heavy":
        return [(prompt(args.long_prompt), args.short_output) for _ in range(count)]
    if name == "decode-heavy":
        return [(prompt(args.short_prompt), args.long_output) for _ in range(count)]
    if name == "shift":  # the mix changes halfway: prefill-heavy, then decode-heavy
        half = count // 2
        return ([(prompt(args.long_prompt), args.short_output) for _ in range(half)]
                + [(prompt(args.short_prompt), args.long_output) for _ in range(count - half)])
    return [(prompt(args.long_prompt if rng.random() < 0.3 else args.short_prompt), args.mixed_output)
            for _ in range(count)]


def start_mode(cluster: Servers, mode: str, policies: tuple[str, ...] = ()) -> tuple[str, list[str]]:
    """The mode's server(s), pinned; returns (URL to send to, the nodes' URLs). ``policies``: for PD, one more router
    per ``--pd-policy`` named, in front of the same nodes (``cluster.routers``: policy -> URL)."""
    if mode == "colocated":
        port = free_port()
        url = cluster.start("colocated", ["taskset", "-c", "0,1", sys.executable, "-m", "fsm_pd.cli", "serve",
                                          "--role", "colocated", "--port", str(port), "--model", cluster.model], port)
        return url, [url]
    boot, p_port, d_port = free_port(), free_port(), free_port()
    tmp = cluster.tmp
    node = [sys.executable, "-m", "fsm_pd.cli", "serve", "--model", cluster.model]
    # --serve-local: the prefill node serves both roles, for the auto router only (the always router sends every
    # request through it as a prefill; docs/serving.md, "No idle core")
    both = ["--serve-local"] if "auto" in policies else []
    prefill = cluster.start("prefill", ["taskset", "-c", "0", *node, "--role", "prefill", "--port", str(p_port),
                                        "--bootstrap-port", str(boot), "--journal", str(tmp / "prefill.db"), *both],
                            p_port)
    decode = cluster.start("decode", ["taskset", "-c", "1", *node, "--role", "decode", "--port", str(d_port),
                                      "--journal", str(tmp / "decode.db")], d_port)
    cluster.routers = {}
    for policy in policies:
        port = free_port()
        cluster.routers[policy] = cluster.start(f"router-{policy}", [
            sys.executable, "-m", "fsm_pd.cli", "serve", "--role", "router", "--port", str(port), "--prefill",
            prefill, str(boot), "--decode", decode, "--pd-policy", policy, "--local-prefill-max-tokens",
            str(cluster.local_prefill_max_tokens), *(["--prefill-serves-local"] if policy == "auto" else [])], port)
    return cluster.router(prefill, boot, decode), [prefill, decode]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests", type=int, default=24,
                        help="requests per rate, at least (default 24; see --min-seconds)")
    parser.add_argument("--min-seconds", type=float, default=40.0,
                        help="more requests at high rates, so that a run's arrivals span at least this long and the "
                             "load reaches its steady state (default 40: 60 requests at 1.5/s)")
    parser.add_argument("--slo-from", type=Path, default=None, metavar="REPORT.json",
                        help="hold each workload to the SLO an earlier run derived (its --json report, or "
                             "bench/slo/*.json) instead of deriving it again: goodputs of two runs compare only "
                             "under one SLO")
    parser.add_argument("--rates", default=DEFAULT_RATES, help=f"requests/s to sweep (default {DEFAULT_RATES})")
    parser.add_argument("--long-prompt", type=int, default=480)
    parser.add_argument("--short-prompt", type=int, default=48)
    parser.add_argument("--short-output", type=int, default=16)
    parser.add_argument("--long-output", type=int, default=128)
    parser.add_argument("--mixed-output", type=int, default=48)
    parser.add_argument("--ttft-scale", type=float, default=5.0)
    parser.add_argument("--tpot-scale", type=float, default=3.0)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--start-rate", type=float, default=None,
                        help="the rate each search starts at (default: the middle of --rates for colocated, and "
                             "colocated's goodput for the PD modes; find_goodput)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--modes", type=lambda v: [m for m in v.split(",") if m], default=list(MODES),
                        help="which setups to measure (default all: colocated, pd, pd-policy; PD with the selective "
                             "policy is --pd-policy auto with the prefill node serving both roles). The colocated node "
                             "always starts: the SLO comes from its isolated runs")
    sweep = parser.add_argument_group("--sweep: the crossover grid (crossover.py)")
    sweep.add_argument("--sweep", action="store_true", help="measure the grid instead of the three mixes")
    sweep.add_argument("--prompts", default="64,256,1024,2048", help="prompt lengths in tokens")
    sweep.add_argument("--outputs", default="16,128", help="new tokens per request")
    sweep.add_argument("--repeat", type=int, default=2, help="rate sweeps per cell and mode (default 2)")
    sweep.add_argument("--repeat-prompts", type=lambda v: sorted({int(p) for p in v.split(",") if p}), default=[],
                       help="repeat only the cells of these prompt lengths (default: every cell): the long prompts' "
                            "runs are the long ones")
    sweep.add_argument("--local-prefill-max-tokens", type=int, default=256,
                       help="the auto router's threshold, for the mixes too (default 256, the router's)")
    sweep.add_argument("--cells-json", default=None, help="also write every cell's runs to this JSON file")
    sweep.add_argument("--docs-dir", default=str(Path(__file__).resolve().parent.parent / "docs"),
                       help="where crossover.md (its table block) and crossover.png go (default docs/)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still stops the nodes (``finally``)
    if args.sweep:
        return main_sweep(args)
    rates = [float(r) for r in args.rates.split(",")]
    names = [w for w in args.workloads.split(",") if w]
    vocab = load_model(args.model).config.vocab_size
    # New prompts for every (workload, rate) and for the isolated runs: the prefix cache (on by default) would
    # otherwise serve a prompt seen at an earlier rate from its pages. Both modes get the same prompts at a rate.
    def load(name: str, rate: float | None) -> list[tuple[list[int], int]]:
        return workload(name, args, random.Random(f"{name} {rate}"), vocab, requests_at(rate, args))

    report = {"model": args.model, "settings": vars(args), "load_average_before": os.getloadavg()[0],
              "workloads": {}}
    with tempfile.TemporaryDirectory() as tmp:
        modes = {}
        for mode in ("colocated", "pd"):
            cluster = Servers(Path(tmp) / mode, args.model)
            cluster.local_prefill_max_tokens = args.local_prefill_max_tokens
            (Path(tmp) / mode).mkdir()
            err.log(f"starting {mode} (each node warms up first)")
            if mode == "pd" and not {"pd", "pd-policy"} & set(args.modes):
                continue
            policies = ("auto",) if mode == "pd" and "pd-policy" in args.modes else ()
            url, nodes = start_mode(cluster, mode, policies)
            modes[mode] = (cluster, url, nodes)
            if policies:  # the same pinned nodes behind a second router: PD with the policy
                modes["pd-policy"] = (cluster, cluster.routers["auto"], nodes)
        try:
            for name in names:
                colocated_url = modes["colocated"][1]
                slo = given_slo(args.slo_from, name) if args.slo_from else isolated_slo(colocated_url, name, load,
                                                                                        args)
                first = slo if isinstance(slo, dict) else slo[0]
                entry = {"slo": first, "slo_from": str(args.slo_from) if args.slo_from else "isolated runs",
                         "isolated": {"ttft": first["ttft"] / args.ttft_scale,
                                      "tpot": first["tpot"] / args.tpot_scale}, "modes": {}}
                if not isinstance(slo, dict):  # shift: each half against its own kind's isolated run
                    entry["slo_by_half"] = slo
                start = args.start_rate
                for mode, (_, url, _) in modes.items():
                    if mode not in args.modes:
                        continue
                    for ids, n in load(name, "warm")[:2]:  # not measured: whatever a mode's first requests pay
                        stream(url, ids, n)
                    err.log(f"{name} {mode}")
                    best, sweep, results = find_goodput(url, lambda rate, name=name: load(name, rate), rates, slo,
                                                        start)
                    start = start or best or None  # the PD modes start where colocated ended
                    entry["modes"][mode] = {
                        "sweep": sweep, "goodput": best, "phases_at_goodput": phases(results) if best else None,
                        "capacity_over_time": {"rate": best or sweep[0]["rate"], "bins": capacity_over_time(results)}}
                colocated_goodput = entry["modes"].get("colocated", {}).get("goodput")
                for mode, key in (("pd", "pd_over_colocated"), ("pd-policy", "policy_over_colocated")):
                    if mode in entry["modes"]:  # None: colocated met no rate, or was not measured (--modes)
                        entry[key] = (entry["modes"][mode]["goodput"] / colocated_goodput if colocated_goodput
                                      else None)
                report["workloads"][name] = entry
            report["compiles_after_startup"] = {mode: sum(serving_compiles(u) for u in nodes)
                                                for mode, (_, _, nodes) in modes.items()}
        finally:
            for cluster in {id(c): c for c, _, _ in modes.values()}.values():  # pd-policy shares pd's
                cluster.stop()
    report["load_average_after"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(report, indent=1, default=str))
    else:
        print_report(report)
    return 0


def isolated_slo(url: str, name: str, load, args) -> dict | tuple[dict, dict]:
    """The SLO from isolated runs on the colocated node (medians of five, times the scales). ``shift``: one SLO per
    half (five of each kind)."""
    def measured(requests) -> dict:
        iso = [stream(url, ids, n) for ids, n in requests]
        return {"ttft": args.ttft_scale * statistics.median(r["ttft"] for r in iso),
                "tpot": args.tpot_scale * statistics.median(r["tpot"] for r in iso)}

    requests = load(name, None)
    if name != "shift":
        return measured(requests[:5])
    half = len(requests) // 2
    return measured(requests[:min(5, half)]), measured(requests[half:half + 5])


def given_slo(path: Path, name: str) -> dict | tuple[dict, dict]:
    """The SLO an earlier run derived for ``name`` (``--slo-from``)."""
    entry = json.loads(path.read_text())["workloads"].get(name)
    if entry is None:
        raise SystemExit(f"--slo-from {path}: no SLO for the {name} workload in it")
    return tuple(entry["slo_by_half"]) if "slo_by_half" in entry else entry["slo"]


def main_sweep(args) -> int:
    import crossover

    vocab = load_model(args.model).config.vocab_size
    report = {"model": args.model, "settings": vars(args), "load_average_before": os.getloadavg()[0]}
    settings = {"model": args.model, "requests": args.requests, "min_seconds": args.min_seconds,
                "rates": args.rates, "repeat": args.repeat,
                "repeat_prompts": ",".join(map(str, args.repeat_prompts)),
                "ttft_scale": args.ttft_scale, "tpot_scale": args.tpot_scale}
    with tempfile.TemporaryDirectory() as tmp:
        clusters = []
        try:
            urls = {}
            for mode in ("colocated", "pd"):
                cluster = Servers(Path(tmp) / mode, args.model)
                cluster.local_prefill_max_tokens = args.local_prefill_max_tokens
                (Path(tmp) / mode).mkdir()
                clusters.append(cluster)
                err.log(f"starting {mode} (each node warms up first)")
                url, nodes = start_mode(cluster, mode, ("always", "auto") if mode == "pd" else ())
                if mode == "pd":
                    urls["pd"], urls["pd-policy"] = cluster.routers["always"], cluster.routers["auto"]
                else:
                    urls[mode] = url
            cells = crossover.run_grid(args, urls, vocab, err.log,
                                       on_cell=lambda done: written(done, settings, args))
        finally:
            for cluster in clusters:
                cluster.stop()
    report["load_average_after"] = os.getloadavg()[0]
    report["cells"] = cells
    page, png = crossover.write_docs(cells, settings, Path(args.docs_dir))
    if args.json:
        print(json.dumps(report, indent=1, default=str))
    else:
        Console(width=150).print(crossover.table(cells, settings))
    err.log(f"wrote {page} and {png}; 1-min load average {report['load_average_before']:.1f} before, "
            f"{report['load_average_after']:.1f} after")
    return 0


def written(cells: list[dict], settings: dict, args) -> None:
    """The docs, and every run behind them (--cells-json), as the grid stands after a cell."""
    import crossover

    crossover.write_docs(cells, settings, Path(args.docs_dir))
    if args.cells_json:
        Path(args.cells_json).write_text(json.dumps({"settings": settings, "cells": cells}, indent=1))


def print_report(report: dict) -> None:
    console = Console(width=150)
    for name, entry in report["workloads"].items():
        slo = entry["slo"]
        table = Table(title=f"{report['model']} {name}: SLO TTFT <= {slo['ttft']:.2f} s, TPOT <= "
                            f"{slo['tpot'] * 1000:.0f} ms (from {entry['slo_from']}: isolated "
                            f"{entry['isolated']['ttft']:.2f} s, {entry['isolated']['tpot'] * 1000:.0f} ms)")
        table.add_column("rate /s", justify="right")
        for mode in entry["modes"]:
            table.add_column(f"{mode} attained", justify="right")
            table.add_column(f"{mode} TTFT p50", justify="right")
            table.add_column(f"{mode} TPOT p50 ms", justify="right")
            table.add_column(f"{mode} missed TTFT/TPOT", justify="right")
        rates = sorted({s["rate"] for m in entry["modes"].values() for s in m["sweep"]})
        for rate in rates:
            row = [f"{rate:g}"]
            for m in entry["modes"].values():
                found = next((s for s in m["sweep"] if s["rate"] == rate), None)
                row += [f"{found['attainment']:.0%}", f"{found['ttft']:.2f}", f"{found['tpot'] * 1000:.0f}",
                        f"{found['ttft_missed']:.0%}/{found['tpot_missed']:.0%}"] if found else ["-"] * 4
            table.add_row(*row)
        console.print(table)
        goodput = {mode: m["goodput"] for mode, m in entry["modes"].items()}
        unmet = "n/a (colocated met the SLO at no rate)" if "colocated" in goodput else "n/a (colocated not measured)"
        console.print("goodput: " + ", ".join(f"{mode} {g:g}/s" for mode, g in goodput.items())
                      + ("; PD / colocated = " + (f"{entry['pd_over_colocated']:.2f}x" if entry.get("pd_over_colocated")
                                                    is not None else unmet))
                      + (f"; PD with the policy / colocated = {entry['policy_over_colocated']:.2f}x"
                         if entry.get("policy_over_colocated") is not None else ""))
        for mode, m in entry["modes"].items():
            if m.get("capacity_over_time") and m["capacity_over_time"]["bins"]:
                served = m["capacity_over_time"]
                console.print(f"  {mode} at {served['rate']:g}/s, where requests went by arrival time: " + "; ".join(
                    f"+{b['from_s']:g} s: " + ", ".join(f"{k} {v}" for k, v in sorted(b["counts"].items()))
                    for b in served["bins"] if b["counts"]))
            if mode == "pd-policy":
                console.print("  pd-policy: share served whole (local) at each rate: " + ", ".join(
                    f"{s['rate']:g}/s {s['local_share']:.0%}" for s in m["sweep"]))
            if m["phases_at_goodput"]:
                console.print(f"  {mode} at its goodput, medians: " + ", ".join(
                    f"{k} {v * 1000:.0f} ms" for k, v in m["phases_at_goodput"].items()))
    console.print(f"compiles after start-up: {report.get('compiles_after_startup')}; 1-min load average "
                  f"{report['load_average_before']:.1f} before, {report['load_average_after']:.1f} after")


if __name__ == "__main__":
    sys.exit(main())
