"""The goodput search behind ``goodput.py`` and ``crossover.py``: send a workload at a rate (Poisson arrivals,
streamed ``/generate``), score each request against the SLO, and walk a rate grid to the highest rate at which 90%
attain it (``find_goodput``); plus the summaries a run reports (where requests were served, TTFT phases)."""

from __future__ import annotations

import json
import math
import random
import statistics
import threading
import time

import httpx
from rich.console import Console

err = Console(stderr=True)


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
