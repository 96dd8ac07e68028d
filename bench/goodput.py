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
>= 90% attainment, found by a walk over them (``find_goodput``); a run at a rate sends --requests requests, more
where they would arrive in under --min-seconds. The table prints attainment per
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
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import Servers, serving_compiles  # noqa: E402 - beside this script

from fsm_pd.launch import free_port
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


def requests_at(rate: float | str | None, args) -> int:
    """Requests in a run at ``rate``: --requests, or more where their arrivals would span under --min-seconds. A run
    whose arrivals end before the first answers do never reaches the steady load the rate stands for (12 requests
    of 128 tokens at 1.5/s arrive in 8 s, about one answer's length)."""
    return max(args.requests, math.ceil(rate * args.min_seconds)) if isinstance(rate, float) else args.requests


def stream(url: str, ids: list[int], new_tokens: int) -> dict:
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}}
    started, arrivals, meta = time.perf_counter(), [], {}
    with httpx.stream("POST", url + "/generate", json=body, timeout=1800) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                arrivals.append(time.perf_counter())
                meta = json.loads(line[5:]).get("meta_info", meta)
    ttft = arrivals[0] - started
    tpot = (arrivals[-1] - arrivals[0]) / max(1, len(arrivals) - 1)
    return {"ttft": ttft, "tpot": tpot, "meta": meta, "start": started}


def at_rate(url: str, requests: list[tuple[list[int], int]], rate: float, rng: random.Random) -> list[dict]:
    """Send ``requests`` with Poisson arrivals at ``rate`` per second; each one's latencies."""
    results: list[dict] = [{}] * len(requests)
    threads = []

    def one(i: int, ids, n) -> None:
        results[i] = stream(url, ids, n)

    for i, (ids, n) in enumerate(requests):
        thread = threading.Thread(target=one, args=(i, ids, n), daemon=True)
        thread.start()
        threads.append(thread)
        time.sleep(rng.expovariate(rate))
    for thread in threads:
        thread.join(1800)
    return results


def find_goodput(url: str, load, rates: list[float], slo: dict | tuple[dict, dict], start: float | None = None
                 ) -> tuple[float, list[dict], list[dict] | None]:
    """Goodput by a walk over the rate grid: the highest rate at which >= 90% of requests attain the SLO.

    It starts at ``start`` (the grid rate nearest it: a previous repeat's goodput, colocated's for the PD modes, the
    middle of the grid when None), walks up a rate at a time while rates attain, or halves its way down to the
    highest that does. Attainment falls as the rate grows (queues only lengthen), so that is the rate an upward sweep
    from the bottom finds, in 2 to 4 runs instead of one per rate below it: a run of N requests at r/s lasts N/r
    seconds, so the low rates an upward sweep starts with cost the most. Goodput 0 means below the grid's lowest
    rate. Returns (goodput, the runs by rate, the results at the goodput or, when no rate attains, at the lowest rate
    run)."""
    at = min(range(len(rates)), key=lambda i: abs(rates[i] - start)) if start else len(rates) // 2
    runs: dict[int, tuple[dict, list[dict]]] = {}

    def attains(i: int) -> bool:
        results = at_rate(url, load(rates[i]), rates[i], random.Random(int(rates[i] * 1000)))
        share = attainment(results, slo)
        runs[i] = ({"rate": rates[i], "attainment": share, "local_share": local_share(results),
                    **missed(results, slo), **phases(results)}, results)
        err.log(f"  {rates[i]:g}/s: {share:.0%} attained (missed TTFT {runs[i][0]['ttft_missed']:.0%}, TPOT "
                f"{runs[i][0]['tpot_missed']:.0%}; medians TTFT {runs[i][0]['ttft']:.2f} s, TPOT "
                f"{runs[i][0]['tpot'] * 1000:.0f} ms)")
        return share >= 0.9

    if attains(at):  # up a rate at a time: the higher the rate, the shorter its run
        best = at
        while best + 1 < len(rates) and attains(best + 1):
            best += 1
    elif runs[at][0]["attainment"] < 0.5 and not one_at_a_time_attains(url, load(rates[0]), slo):
        best = -1  # no rate attains what one request at a time does not: the long runs at low rates are spared
    else:  # down by halves: the lower the rate, the longer its run
        best, failed = -1, at
        while failed - best > 1:
            middle = (best + failed) // 2
            best, failed = (middle, failed) if attains(middle) else (best, middle)
    shown = runs[best][1] if best >= 0 else runs[min(runs)][1]
    return (rates[best] if best >= 0 else 0.0), [runs[i][0] for i in sorted(runs)], shown


def one_at_a_time_attains(url: str, requests: list[tuple[list[int], int]], slo: dict | tuple[dict, dict],
                          count: int = 8) -> bool:
    """Whether ``count`` of the requests, sent one after another (the limit of a rate near 0), attain the SLO at 90%.
    A run at 0.05/s of 24 requests lasts 8 minutes; this lasts ``count`` requests' latency."""
    results = [stream(url, ids, n) for ids, n in requests[:count]]
    share = attainment(results, _slos(slo, len(requests))[:count])
    err.log(f"  one at a time: {share:.0%} attained")
    return share >= 0.9


def _slos(slo: dict | tuple[dict, dict] | list[dict], n: int) -> list[dict]:
    """One SLO per request: the workload's, or (``shift``, a pair) each half its kind's; a list is one already."""
    if isinstance(slo, list):
        return slo
    if isinstance(slo, dict):
        return [slo] * n
    first, second = slo
    return [first] * (n // 2) + [second] * (n - n // 2)


def attainment(results: list[dict], slo: dict | tuple[dict, dict] | list[dict]) -> float:
    ok = [r for r, s in zip(results, _slos(slo, len(results)), strict=True)
          if r and r["ttft"] <= s["ttft"] and r["tpot"] <= s["tpot"]]
    return len(ok) / len(results)


def missed(results: list[dict], slo: dict | tuple[dict, dict]) -> dict:
    """Which half of the SLO the requests missed: the share over the TTFT bound, and over the TPOT bound."""
    pairs = list(zip(results, _slos(slo, len(results)), strict=True))
    return {"ttft_missed": sum(not r or r["ttft"] > s["ttft"] for r, s in pairs) / len(results),
            "tpot_missed": sum(not r or r["tpot"] > s["tpot"] for r, s in pairs) / len(results)}


def where_served(result: dict) -> str:
    route = (result.get("meta") or {}).get("pd_route") or {}
    if not route:
        return "colocated"
    if route.get("path") == "pd":
        return "P+D"
    return "whole on P" if str(route.get("node", "")).startswith("prefill") else "whole on D"


def capacity_over_time(results: list[dict], bins: int = 6) -> list[dict]:
    """Where the requests went, by arrival time in ``bins`` equal slices of the run: through P and D (``P+D``),
    whole on the decode node, whole on the prefill node (the policy's local path), or colocated."""
    done = [r for r in results if r]
    if not done:
        return []
    t0 = min(r["start"] for r in done)
    span = max(r["start"] for r in done) - t0 or 1.0
    out = [{"from_s": round(i * span / bins, 1), "counts": {}} for i in range(bins)]
    for r in done:
        slot = out[min(bins - 1, int((r["start"] - t0) / span * bins))]["counts"]
        slot[where_served(r)] = slot.get(where_served(r), 0) + 1
    return out


def local_share(results: list[dict]) -> float:
    """The share of requests a node served whole (``meta_info.pd_route.path == "local"``: the policy at work)."""
    return sum(1 for r in results if r and (r["meta"].get("pd_route") or {}).get("path") == "local") / len(results)


def phases(results: list[dict]) -> dict:
    """Medians of the TTFT phases a PD answer's meta_info names (SGLang's names), and of the TTFT itself."""
    out = {"ttft": statistics.median(r["ttft"] for r in results if r),
           "tpot": statistics.median(r["tpot"] for r in results if r)}
    for name in ("queue_time", "bootstrap_duration", "waiting_duration", "transfer_duration"):
        values = [r["meta"][name] for r in results if r and name in r.get("meta", {})]
        if values:
            out[name] = statistics.median(values)
    return out


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
            cells = crossover.run_grid(args, urls, vocab, sys.modules[__name__], err.log,
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
