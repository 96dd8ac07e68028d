"""Serving latency and throughput: 1 prefill + 1 decode behind the built-in router versus one colocated server.

Starts the servers itself (`fsm-pd serve`, SmolLM2 unless --model, 127.0.0.1; with the process helpers of
`fsm-pd launch`, so it runs after `pip install -e .` alone), then for each concurrency level
sends streamed `/generate` requests and measures, per request, time to first token (TTFT) and the gaps between
later tokens (inter-token latency, ITL); per run, requests/s and output tokens/s. Prints p50/p99 and the PD/colocated
ratio of each figure, and the share of PD's TTFT spent moving KV (decode journal: READY -> scattered).
Every server and the client share this machine's cores, so PD (three processes) competes with itself here.

    python bench/serving.py [--model smollm2|tiny|PATH] [--concurrency 1 8 32] [--requests-per-level 32]
                            [--max-new-tokens 32] [--json]

Each server warms up before it serves (its default); the programs any of them compiled while the bench ran are
read off its /metrics and printed (they must be 0).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from fsm_pd.cli.launch import HEALTH_TIMEOUT_S, Child, free_port, stop, wait_healthy
from fsm_pd.store import read_journal
from fsm_pd.transport import generate_secret, secret_env


def wait_compiled(url: str, timeout: float = HEALTH_TIMEOUT_S) -> None:
    """Wait until a ready node's background compile is done: the figures are of a node that serves at its steady
    speed, whose every shape is compiled (``/server_info``: ``startup.background_compile``)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        startup = httpx.get(url + "/server_info", timeout=30).json().get("startup") or {}
        if startup.get("background_compile", "running") != "running":
            return
        time.sleep(0.5)
    raise RuntimeError(f"{url}: the background compile did not finish within {timeout:.0f} s")


class Servers:
    """The `fsm-pd serve` processes this bench starts on 127.0.0.1, stopped by PID (launch's ``stop``) at the end."""

    def __init__(self, tmp: Path, model: str):
        self.tmp, self.model, self.children = tmp, model, []
        self.env = {**os.environ, **secret_env(generate_secret())}

    def start(self, name: str, argv: list[str], port: int) -> str:
        child = Child(name, argv, f"http://127.0.0.1:{port}", self.tmp / f"{name}.log")
        child.proc = subprocess.Popen(argv, stdout=open(child.log, "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
                                      env=self.env, stdin=subprocess.DEVNULL)
        self.children.append(child)
        wait_healthy(child, time.time() + HEALTH_TIMEOUT_S)
        return child.url

    def serve(self, role: str, *extra: str) -> str:
        port = free_port()
        argv = [sys.executable, "-m", "fsm_pd.cli", "serve", "--role", role, "--port", str(port),
                "--model", self.model, *extra]
        if role in ("prefill", "decode"):
            argv += ["--journal", str(self.tmp / f"{role}-{port}.db"), "--node-id", f"{role}-{port}"]
        url = self.start(f"{role}-{port}", argv, port)
        wait_compiled(url)
        return url

    def pd(self, backend: str) -> tuple[str, int, str]:
        boot = free_port()
        prefill = self.serve("prefill", "--bootstrap-port", str(boot), "--transfer-backend", backend)
        return prefill, boot, self.serve("decode", "--transfer-backend", backend)

    def router(self, prefill: str, boot: int, decode: str) -> str:
        """Classic PD (``--pd-policy always``): the benches that start it measure the handoff, which the default
        policy would skip for their short prompts."""
        port = free_port()
        return self.start("router", [sys.executable, "-m", "fsm_pd.cli", "serve", "--role", "router", "--port",
                                     str(port), "--prefill", prefill, str(boot), "--decode", decode,
                                     "--pd-policy", "always"], port)

    def stop(self) -> None:
        stop(self.children)


def one_request(url: str, prompt: str, max_new_tokens: int) -> dict:
    body = {"text": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
    start = time.perf_counter()
    arrivals = []
    with httpx.stream("POST", url + "/generate", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                arrivals.append(time.perf_counter())
    return {"ttft": arrivals[0] - start, "itl": [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)],
            "tokens": max_new_tokens, "end": arrivals[-1]}


def run_level(url: str, prompts: list[str], concurrency: int, max_new_tokens: int, progress, task) -> dict:
    started = time.perf_counter()

    def work(prompt):
        out = one_request(url, prompt, max_new_tokens)
        progress.advance(task)
        return out

    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(work, prompts))
    elapsed = time.perf_counter() - started
    ttft = sorted(r["ttft"] for r in results)
    itl = sorted(g for r in results for g in r["itl"])
    return {"ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99),
            "requests_per_s": len(results) / elapsed,
            "output_tokens_per_s": sum(r["tokens"] for r in results) / elapsed}


def serving_compiles(url: str) -> int:
    """Programs the server at ``url`` compiled after its start-up (``fsm_pd_compiles_total{phase="serving"}``)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith('fsm_pd_compiles_total{phase="serving"}')))


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def transfer_seconds(journals: list[Path]) -> list[float]:
    """Per decode room: READY (kv_published) to scattered, from the journal."""
    spans = []
    for journal in journals:
        rows = read_journal(journal)
        started = {r.room: r.at for r in rows if r.role == "decode" and r.trigger == "kv_published"}
        spans += [r.at - started[r.room] for r in rows
                  if r.role == "decode" and r.trigger == "scattered" and r.room in started]
    return spans


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2 (default), tiny, a .gguf file or an HF directory")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests-per-level", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=96, help="approximate prompt length (default 96)")
    parser.add_argument("--backend", default="tcp", help="PD transfer backend (default tcp)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    console = Console(stderr=True)
    rng = random.Random(0)
    prompts = ["".join(rng.choice("abcdefghij klmnop") for _ in range(rng.randint(args.prompt_tokens // 2,
                                                                                   args.prompt_tokens * 3 // 2)))
               for _ in range(args.requests_per_level)]

    with tempfile.TemporaryDirectory() as tmp:
        cluster = Servers(Path(tmp), args.model)
        try:
            with console.status("starting colocated, prefill, decode and router (first start compiles)"):
                urls = {"colocated": cluster.serve("colocated"), "pd": cluster.router(*cluster.pd(args.backend))}
            for url in urls.values():  # one untimed round: connections and caches, not compiles (the servers warmed up)
                with ThreadPoolExecutor(8) as pool:
                    list(pool.map(lambda p, u=url: one_request(u, p, args.max_new_tokens), prompts[:8]))
            figures: dict[str, dict] = {"colocated": {}, "pd": {}}
            total = len(urls) * len(args.concurrency) * len(prompts)
            with Progress(console=console) as progress:
                task = progress.add_task("requests", total=total)
                for level in args.concurrency:
                    for mode, url in urls.items():
                        figures[mode][level] = run_level(url, prompts, level, args.max_new_tokens, progress, task)
            spans = transfer_seconds(sorted(Path(tmp).glob("decode-*.db")))
            late = {c.name: serving_compiles(c.url) for c in cluster.children if not c.name.startswith("router")}
        finally:
            cluster.stop()

    pd_ttft = statistics.mean(figures["pd"][lvl]["ttft_p50"] for lvl in args.concurrency)
    result = {"model": args.model, "backend": args.backend, "requests_per_level": args.requests_per_level,
              "max_new_tokens": args.max_new_tokens, "levels": {}, "load_average": os.getloadavg(),
              "kv_transfer_seconds_median": statistics.median(spans) if spans else None,
              "kv_transfer_share_of_pd_ttft_p50": (statistics.median(spans) / pd_ttft) if spans else None,
              "compiles_after_startup": late}
    for level in args.concurrency:
        pd, co = figures["pd"][level], figures["colocated"][level]
        result["levels"][level] = {"pd": pd, "colocated": co,
                                   "pd_over_colocated": {k: pd[k] / co[k] if co[k] else None for k in pd}}
    if args.json:
        print(json.dumps(result))
        return 0
    table = Table(title=f"1P1D ({args.backend}) vs colocated, {args.model}, "
                        f"{args.requests_per_level} requests per level")
    for name in ("concurrency", "mode", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "req/s", "out tok/s"):
        table.add_column(name, justify="right")
    for level in args.concurrency:
        for mode in ("colocated", "pd", "pd_over_colocated"):
            f = result["levels"][level][mode]
            fmt = (lambda v: f"{v:.2f}x") if mode == "pd_over_colocated" else (lambda v: f"{v * 1000:.1f}ms")
            table.add_row(str(level), mode, fmt(f["ttft_p50"]), fmt(f["ttft_p99"]), fmt(f["itl_p50"]),
                          fmt(f["itl_p99"]), f"{f['requests_per_s']:.2f}" if mode != "pd_over_colocated" else
                          fmt(f["requests_per_s"]), f"{f['output_tokens_per_s']:.1f}" if mode != "pd_over_colocated"
                          else fmt(f["output_tokens_per_s"]))
    Console(width=120).print(table)
    print("programs compiled after start-up: " + ", ".join(f"{name} {n}" for name, n in late.items()))
    if spans:
        print(f"KV transfer (decode: READY -> scattered) median {statistics.median(spans) * 1000:.1f} ms = "
              f"{result['kv_transfer_share_of_pd_ttft_p50']:.0%} of PD's median TTFT "
              f"(load average {result['load_average'][0]:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
