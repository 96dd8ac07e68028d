"""Multi-turn chat through PD with and without prefix caches: TTFT per turn, prefill work, KV bytes, hit ratio.

Every conversation shares one system prompt (about --system-tokens tokens) and adds about --user-tokens of user text
per turn; each answer is --answer-tokens long (greedy, EOS ignored). A turn's request carries the whole history, as a
chat client sends it, through the built-in router's OpenAI route, streamed. --concurrency conversations run at once,
each turn after the last. One run, the real model (SmolLM2 unless --model), these variants:

- ``1p1d-off``: one prefill (``--disable-radix-cache``), one decode;
- ``1p1d-on``: the prefill node's cache on (its default);
- ``1p1d-on+d``: and the decode node's own (``--disaggregation-decode-enable-radix-cache``);
- ``2p1d-rr``: two prefill nodes with their caches, the router's ``--policy round_robin``;
- ``2p1d-aware``: the same, ``--policy cache_aware``.

Per variant and turn: TTFT p50/p90 (request sent to first streamed token); per variant: prompt tokens the prefill
nodes computed and took from their caches (their /metrics), the hit ratio, and KV bytes sent per request (from the
decode journal: pages each READY announced). Then the ratios the issue asks for: TTFT from turn 3 on, off / on; KV
bytes per request from turn 2 on, on / on+d; hit ratio, cache_aware / round_robin.

    python bench/prefix_cache.py [--model smollm2] [--conversations 16] [--turns 6] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import Servers, pct, serving_compiles  # noqa: E402 - beside this script

from fsm_pd.cli.launch import free_port
from fsm_pd.model.loader import load_model
from fsm_pd.store import read_journal

VARIANTS = ("1p1d-off", "1p1d-on", "1p1d-on+d", "2p1d-rr", "2p1d-aware")
WORDS = ("river", "stone", "lantern", "orchard", "harbor", "meadow", "falcon", "ember", "willow", "canyon", "glacier",
         "summit", "compass", "thistle", "ledger", "beacon", "quarry", "tundra", "marble", "saffron")
err = Console(stderr=True)


def text_of(tokens: int, seed: int) -> str:
    """About ``tokens`` tokens of plain words (SmolLM2's tokenizer: about one word each, with the space)."""
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(tokens))


def start(cluster: Servers, variant: str, tmp: Path) -> tuple[str, list[str], list[str]]:
    """The variant's nodes and router; returns (router URL, prefill URLs, decode URLs)."""
    prefills = 2 if variant.startswith("2p") else 1
    p_flags = ["--disable-radix-cache"] if variant == "1p1d-off" else []
    d_flags = ["--disaggregation-decode-enable-radix-cache"] if variant == "1p1d-on+d" else []
    router_args, p_urls = [], []
    for _ in range(prefills):
        boot = free_port()
        url = cluster.serve("prefill", "--bootstrap-port", str(boot), *p_flags)
        p_urls.append(url)
        router_args += ["--prefill", url, str(boot)]
    d_url = cluster.serve("decode", *d_flags)
    policy = "cache_aware" if variant == "2p1d-aware" else "round_robin" if variant == "2p1d-rr" else \
        "least_outstanding"
    port = free_port()
    router = cluster.start(f"router-{variant}", [sys.executable, "-m", "fsm_pd.cli", "serve", "--role", "router",
                                                  "--port", str(port), *router_args, "--decode", d_url,
                                                  "--policy", policy, "--pd-policy", "always"], port)
    return router, p_urls, [d_url]


def chat_turn(url: str, model: str, messages: list[dict], answer_tokens: int, rid: str) -> tuple[float, str]:
    """(TTFT seconds, the answer's text) of one streamed chat request."""
    body = {"model": model, "messages": messages, "max_tokens": answer_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "rid": rid}
    started, first, text = time.perf_counter(), None, []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            delta = json.loads(line[5:])["choices"][0]["delta"].get("content") or ""
            if delta and first is None:
                first = time.perf_counter()
            text.append(delta)
    return (first or time.perf_counter()) - started, "".join(text)


def prefill_tokens(urls: list[str]) -> dict[str, float]:
    totals = {"computed": 0.0, "cached": 0.0}
    for url in urls:
        for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
            for kind in totals:
                if line.startswith("fsm_pd_prefill_tokens_total{") and f'kind="{kind}"' in line:
                    totals[kind] += float(line.rsplit(" ", 1)[1])
    return totals


def bytes_per_turn(journals: list[Path], page_bytes: int, turns: int) -> dict[int, float]:
    """Median KV bytes per request's READY, by turn (the decode journal has each room's rid:
    ``c<conversation>-t<turn>``)."""
    rids, pages = {}, {}
    for journal in journals:
        for row in read_journal(journal):
            if row.role != "decode":
                continue
            if row.trigger == "create" and "rid" in row.event:
                rids[row.room] = row.event["rid"]
            elif row.trigger == "kv_published":
                pages[row.room] = int(row.event.get("page_count", 0))
    by_turn: dict[int, list[int]] = {t: [] for t in range(1, turns + 1)}
    for room, count in pages.items():
        rid = rids.get(room, "")
        if "-t" in rid:
            by_turn[int(rid.rsplit("-t", 1)[1])].append(count * page_bytes)
    return {t: statistics.median(v) if v else float("nan") for t, v in by_turn.items()}


def run_variant(variant: str, args, page_bytes: int, tmp: Path, progress, task) -> dict:
    cluster = Servers(tmp / variant, args.model)
    (tmp / variant).mkdir()
    try:
        err.log(f"{variant}: starting (each node warms up first)")
        router, p_urls, d_urls = start(cluster, variant, tmp)
        system = text_of(args.system_tokens, 0)
        ttft: dict[int, list[float]] = {t: [] for t in range(1, args.turns + 1)}
        lock = threading.Lock()

        def conversation(c: int) -> None:
            messages = [{"role": "system", "content": system}]
            for turn in range(1, args.turns + 1):
                user = f"({c}.{turn}) " + text_of(args.user_tokens, c * 31 + turn)
                messages.append({"role": "user", "content": user})
                seconds, answer = chat_turn(router, args.model_name, messages, args.answer_tokens, f"c{c}-t{turn}")
                messages.append({"role": "assistant", "content": answer})
                with lock:
                    ttft[turn].append(seconds)
                progress.advance(task)

        before = prefill_tokens(p_urls)
        started = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(conversation, range(args.conversations)))
        elapsed = time.perf_counter() - started
        after = prefill_tokens(p_urls)
        late = sum(serving_compiles(u) for u in p_urls + d_urls)
    finally:
        cluster.stop()
    tokens = {k: after[k] - before[k] for k in after}
    sent = bytes_per_turn(sorted((tmp / variant).glob("decode-*.db")), page_bytes, args.turns)
    return {"ttft_p50": {t: pct(sorted(v), 50) for t, v in ttft.items()},
            "ttft_p90": {t: pct(sorted(v), 90) for t, v in ttft.items()},
            "prefill_computed_tokens": tokens["computed"], "prefill_cached_tokens": tokens["cached"],
            "hit_ratio": tokens["cached"] / max(1.0, tokens["computed"] + tokens["cached"]),
            "kv_bytes_per_request": sent, "seconds": elapsed, "compiles_after_startup": late}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=400)
    parser.add_argument("--user-tokens", type=int, default=60)
    parser.add_argument("--answer-tokens", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=4, help="conversations at once (default 4)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    args.model_name = args.model
    model = load_model(args.model)
    page_bytes = model.make_kv_layout(2, 16).page_bytes()
    variants = [v for v in args.variants.split(",") if v]
    report = {"model": args.model, "settings": {k: getattr(args, k) for k in (
        "conversations", "turns", "system_tokens", "user_tokens", "answer_tokens", "concurrency")},
        "load_average_before": os.getloadavg()[0], "variants": {}}
    with tempfile.TemporaryDirectory() as tmp, Progress(console=err, transient=True) as progress:
        task = progress.add_task("turns", total=len(variants) * args.conversations * args.turns)
        for variant in variants:
            report["variants"][variant] = run_variant(variant, args, page_bytes, Path(tmp), progress, task)
    report["load_average_after"] = os.getloadavg()[0]
    report["ratios"] = ratios(report["variants"], args.turns)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_report(report, args.turns)
    return 0


def ratios(v: dict, turns: int) -> dict:
    out = {}
    late = range(3, turns + 1)
    if "1p1d-off" in v and "1p1d-on" in v:
        out["ttft_p50_off_over_on_from_turn_3"] = statistics.median(
            v["1p1d-off"]["ttft_p50"][t] / v["1p1d-on"]["ttft_p50"][t] for t in late)
    if "1p1d-on" in v and "1p1d-on+d" in v:
        on, ond = v["1p1d-on"]["kv_bytes_per_request"], v["1p1d-on+d"]["kv_bytes_per_request"]
        out["kv_bytes_on_over_on_d_from_turn_2"] = statistics.median(
            on[t] / max(ond[t], 1.0) for t in range(2, turns + 1))
    if "2p1d-rr" in v and "2p1d-aware" in v:
        out["hit_ratio_aware_over_rr"] = v["2p1d-aware"]["hit_ratio"] / max(v["2p1d-rr"]["hit_ratio"], 1e-9)
    return out


def print_report(report: dict, turns: int) -> None:
    console = Console(width=160)
    table = Table(title=f"{report['model']}: multi-turn chat, TTFT p50 / p90 per turn (seconds)")
    table.add_column("variant")
    for t in range(1, turns + 1):
        table.add_column(f"turn {t}", justify="right")
    for name, v in report["variants"].items():
        table.add_row(name, *(f"{v['ttft_p50'][t]:.2f} / {v['ttft_p90'][t]:.2f}" for t in range(1, turns + 1)))
    console.print(table)
    table = Table(title="prefill work, KV bytes, hit ratio")
    for column in ("variant", "tokens computed", "tokens cached", "hit ratio", "KV MB turn 1", "KV MB turn 2+",
                   "compiles after start-up", "seconds"):
        table.add_column(column, justify="right")
    for name, v in report["variants"].items():
        later = [v["kv_bytes_per_request"][t] for t in range(2, turns + 1)]
        table.add_row(name, f"{v['prefill_computed_tokens']:,.0f}", f"{v['prefill_cached_tokens']:,.0f}",
                      f"{v['hit_ratio']:.1%}", f"{v['kv_bytes_per_request'][1] / 1e6:.2f}",
                      f"{statistics.median(later) / 1e6:.2f}", str(v["compiles_after_startup"]), f"{v['seconds']:.0f}")
    console.print(table)
    for name, value in report["ratios"].items():
        console.print(f"{name}: {value:.2f}x")
    console.print(f"1-min load average {report['load_average_before']:.1f} before, {report['load_average_after']:.1f} "
                  "after")


if __name__ == "__main__":
    sys.exit(main())
