"""PD's fixed cost: at concurrency 1, what a PD request's time to first token (TTFT) pays beyond a colocated one's.

One run on the model a user gets (SmolLM2 unless --model), with the defaults a user gets: one colocated server, and
1 prefill + 1 decode (tcp, the default backend) behind the built-in router, all started here on 127.0.0.1. Streamed
``/generate`` requests go one at a time, alternating between the two setups; every prompt is new (random token ids),
so no prefix cache hides the prefill. Then the TTFT is split into phases from the servers' own histograms (the
change of ``_sum`` / ``_count`` over the run, a mean per request):

- colocated: ``queue`` and ``prefill`` (``fsm_pd_request_phase_seconds``), and ``http`` (the client's TTFT minus
  the node's own ``first_token``: the HTTP hop and the stream's first chunk);
- PD: ``router + http`` (the client's TTFT minus the decode node's ``first_token``), the decode node's
  ``bootstrap`` (``fsm_pd_transfer_phase_seconds``: resolving P, reserving pages, PREPARE), the prefill node's
  ``queue`` and ``prefill``, ``publish + READY`` (what the decode node's ``waiting`` holds beyond P's queue and
  prefill), the decode node's ``transfer`` (pull and scatter) and ``admission`` (transfer end to first token out).

The target (the issue "PD pays for itself"): PD's median TTFT minus colocated's is at most the transfer plus 5 ms.

    python bench/pd_fixed_cost.py [--model smollm2|tiny|PATH] [--prompt-tokens 512] [--requests 20] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import Servers, serving_compiles  # noqa: E402 - beside this script

HISTOGRAMS = ("fsm_pd_request_phase_seconds", "fsm_pd_transfer_phase_seconds")
MARGIN_S = 0.005


def histograms(url: str) -> dict[tuple[str, str, str], list[float]]:
    """(metric, role, phase) -> [count, sum] off the server's /metrics."""
    found: dict[tuple[str, str, str], list[float]] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        m = re.match(r'(\w+)_(count|sum)\{([^}]*)\} (\S+)', line)
        if not m or m.group(1) not in HISTOGRAMS:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(3)))
        found.setdefault((m.group(1), labels["role"], labels["phase"]), [0.0, 0.0])[m.group(2) == "sum"] = float(
            m.group(4))
    return found


def means(before: dict, after: dict) -> dict[tuple[str, str, str], float]:
    """Seconds per observation over the run, for each histogram that moved."""
    out = {}
    for key, (count, total) in after.items():
        c0, s0 = before.get(key, (0.0, 0.0))
        if count > c0:
            out[key] = (total - s0) / (count - c0)
    return out


def ttft(client: httpx.Client, url: str, ids: list[int]) -> float:
    """Seconds to the first streamed chunk. The client is made once: a new ``httpx.Client`` builds an SSL context
    (tens of ms), which is the client's cost, not the server's."""
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}}
    started, first = time.perf_counter(), None
    with client.stream("POST", url + "/generate", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():  # all of it, so the node is idle before the next request
            if first is None and line.startswith("data:") and line != "data: [DONE]":
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError(f"{url} streamed no token")
    return first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (default), tiny, or a path")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="tokens per prompt (default 512)")
    parser.add_argument("--requests", type=int, default=20, help="measured requests per setup (default 20)")
    parser.add_argument("--warm", type=int, default=3, help="unmeasured requests per setup first (default 3)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = parser.parse_args()
    console, rng = Console(stderr=True), random.Random(0)
    vocab = 0

    def prompt() -> list[int]:
        return [rng.randrange(10, vocab - 10) for _ in range(args.prompt_tokens)]

    with tempfile.TemporaryDirectory() as tmp:
        servers = Servers(Path(tmp), args.model)
        try:
            console.print(f"starting a colocated server and 1P1D + router ({args.model}) ...")
            colocated = servers.serve("colocated")
            prefill, boot, decode = servers.pd("tcp")
            router = servers.router(prefill, boot, decode)
            vocab = int(httpx.get(colocated + "/model_info", timeout=30).json()["vocab_size"])
            client = httpx.Client(timeout=600)
            for _ in range(args.warm):
                ttft(client, colocated, prompt())
                ttft(client, router, prompt())
            nodes = {"colocated": colocated, "prefill": prefill, "decode": decode}
            before = {name: histograms(url) for name, url in nodes.items()}
            colo_s, pd_s = [], []
            for i in range(args.requests):
                colo_s.append(ttft(client, colocated, prompt()))
                pd_s.append(ttft(client, router, prompt()))
                console.print(f"  {i + 1}/{args.requests}: colocated {colo_s[-1] * 1e3:.1f} ms, "
                              f"PD {pd_s[-1] * 1e3:.1f} ms", highlight=False)
            moved = {name: means(before[name], histograms(url)) for name, url in nodes.items()}
            compiles = {name: serving_compiles(url) for name, url in nodes.items()}
        finally:
            servers.stop()

    def phase(node: str, metric: str, role: str, name: str) -> float:
        return moved[node].get((metric, role, name), float("nan"))

    req, xfer = "fsm_pd_request_phase_seconds", "fsm_pd_transfer_phase_seconds"
    colo_ttft, pd_ttft = statistics.median(colo_s), statistics.median(pd_s)
    p_queue, p_prefill = phase("prefill", req, "prefill", "queue"), phase("prefill", req, "prefill", "prefill")
    colocated_rows = {
        "http": colo_ttft - phase("colocated", req, "colocated", "first_token"),
        "queue": phase("colocated", req, "colocated", "queue"),
        "prefill": phase("colocated", req, "colocated", "prefill"),
    }
    pd_rows = {
        "router + http": pd_ttft - phase("decode", req, "decode", "first_token"),
        "bootstrap (decode)": phase("decode", xfer, "decode", "bootstrap"),
        "queue (prefill)": p_queue,
        "prefill (prefill)": p_prefill,
        "publish + READY": phase("decode", xfer, "decode", "waiting") - p_queue - p_prefill,
        "transfer (decode)": phase("decode", xfer, "decode", "transfer"),
        "admission (decode)": phase("decode", req, "decode", "admission"),
    }
    transfer, extra = pd_rows["transfer (decode)"], pd_ttft - colo_ttft
    figures = {"model": args.model, "prompt_tokens": args.prompt_tokens, "requests": args.requests,
               "ttft_ms": {"colocated": colo_ttft * 1e3, "pd": pd_ttft * 1e3, "pd_minus_colocated": extra * 1e3},
               "colocated_ms": {k: v * 1e3 for k, v in colocated_rows.items()},
               "pd_ms": {k: v * 1e3 for k, v in pd_rows.items()},
               "target_ms": (transfer + MARGIN_S) * 1e3, "holds": extra <= transfer + MARGIN_S,
               "compiles_while_serving": compiles}

    table = Table(title=f"TTFT at concurrency 1, {args.prompt_tokens}-token prompts, {args.model} "
                        f"(medians of {args.requests}; phases: histogram means)")
    table.add_column("phase")
    table.add_column("colocated ms", justify="right")
    table.add_column("PD ms", justify="right")
    for name, value in colocated_rows.items():
        table.add_row(name, f"{value * 1e3:.1f}", "")
    for name, value in pd_rows.items():
        table.add_row(name, "", f"{value * 1e3:.1f}")
    table.add_row("TTFT (client, median)", f"{colo_ttft * 1e3:.1f}", f"{pd_ttft * 1e3:.1f}")
    Console().print(table)
    verdict = "holds" if figures["holds"] else "does not hold"
    print(f"PD - colocated = {extra * 1e3:.1f} ms; transfer + 5 ms = {figures['target_ms']:.1f} ms: {verdict}. "
          f"Programs compiled while serving: {compiles}")
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
