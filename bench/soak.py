"""Memory soak: does a node's RSS stay flat over many short requests?

Starts a `fsm-pd launch`-style cluster (the same process plan: prefill and decode `fsm-pd serve` children and the
built-in router, tiny model, tcp transfers, on 127.0.0.1), sends ``--requests`` short generations through the router
with at most ``--concurrency`` in flight (a mix of whole and streamed `/generate` and `/v1/completions` calls, greedy
and sampled), and reads each process's RSS from /proc after the warm-up and at the end. What a node keeps per
request shows up as KB per request = (RSS at end - RSS after warm-up) / requests after warm-up. Every request must
succeed.

    python bench/soak.py [--requests 20000] [--warmup 12000] [--warmup-s 90] [--concurrency 16] [--rate 50] [--json]

The target (issue 11) is under 0.05 KB per request on every node. The warm-up first sweeps the shapes the servers
compile (every batch size up to ``--concurrency``, greedy, sampled and mixed batches, each with the shortest prompts
alone, the longest alone and the mix), as fast as it can: a program compiled late shows up as a step of megabytes
that is not a leak, and the report counts the code mappings a node added during the soak (XLA maps each program it
loads) to say so. It then runs the soak's own mix for ``--warmup`` requests and at least ``--warmup-s`` seconds,
because a node's time-windowed tables (the side channel's replay nonces and delivered keys, 60 s; the garbage
between two full collections, 10 s) fill to request rate x window and only then is RSS steady. For the same reason
the mixed warm-up and the soak run at one fixed ``--rate`` (at most ``--concurrency`` in flight), below what a
shared 2-core machine sustains: run as fast as possible, the rate wanders with the machine's other load (70 to 130
requests/s), and every new high in the rate raised those tables, and RSS, by a megabyte or two that no request
keeps. Pacing changes when requests start, not what they are. ``--json`` adds the RSS samples taken every 10 s.
``--smaps DIR`` saves every child's /proc/PID/smaps (and its threads) at the end of the warm-up and at every sample,
as ``DIR/<name>-<requests after warm-up>.smaps.gz``; `bench/smaps.py` diffs them by mapping to say where a step went.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from fsm_pd.cli.launch import HEALTH_TIMEOUT_S, free_port, plan, stop, wait_healthy
from fsm_pd.transport import generate_secret, secret_env

sys.path.insert(0, str(Path(__file__).parent))
import smaps  # noqa: E402 - bench/smaps.py, a sibling script

TEXT = "the quick brown fox jumps over a lazy dog while seven wise owls watch from an old oak"
SAMPLE_EVERY_S = 10.0


def save_smaps(directory: Path | None, children, requests: int) -> None:
    if directory is not None:
        for c in children:
            smaps.save(c.proc.pid, directory / f"{c.name}-{requests}.smaps.gz")


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def request_for(i: int, temperature: float | None = None) -> tuple[str, dict]:
    """Short prompts of a few lengths, varied text; a quarter greedy OpenAI completions unless ``temperature``
    sets every request's."""
    vocabulary = TEXT.split()
    prompt = " ".join(vocabulary[(i * 7 + k) % len(vocabulary)] for k in range(2 + i % 5))
    kind = i % 4
    if kind == 3:
        return "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 4, "stream": i % 8 == 7,
                                   "temperature": 0.0 if temperature is None else temperature}
    return "/generate", {"text": prompt, "stream": kind == 1,
                         "sampling_params": {"max_new_tokens": 4, "ignore_eos": True,
                                             "temperature": 0.7 if temperature is None else temperature}}


async def one(client: httpx.AsyncClient, url: str, i: int, temperature: float | None) -> str | None:
    """None if the request succeeded, else what went wrong."""
    path, body = request_for(i, temperature)
    try:
        async with client.stream("POST", url + path, json=body) as r:
            text = (await r.aread()).decode("utf-8", errors="replace")
    except httpx.HTTPError as err:
        return f"{type(err).__name__}: {err}"
    if r.status_code != 200:
        return f"{r.status_code}: {text[:200]}"
    if body.get("stream") and ('"error"' in text or not text.rstrip().endswith("data: [DONE]")):
        return f"stream ended badly: {text[-200:]}"
    return None


class Pacer:
    """Starts at most ``rate`` requests per second (0: no limit), evenly spaced; never bursts to catch up."""

    def __init__(self, rate: float):
        self.interval = 1.0 / rate if rate > 0 else 0.0
        self.next = 0.0

    async def wait(self) -> None:
        if self.interval:
            now = time.perf_counter()
            start = max(self.next, now)
            self.next = start + self.interval
            await asyncio.sleep(start - now)


async def drive(url: str, indices, concurrency: int, advance, failures: list,
                temperature: float | None = None, rate: float = 0.0) -> None:
    """Requests ``request_for(i)`` for every ``i`` of ``indices``, at most ``concurrency`` at a time and ``rate``
    per second."""
    queue = iter(indices)
    pacer = Pacer(rate)
    timeout = httpx.Timeout(120.0, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=concurrency)) as client:
        async def worker():
            for i in queue:
                await pacer.wait()
                problem = await one(client, url, i, temperature)
                if problem is not None:
                    failures.append((i, problem))
                advance()

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def code_maps(pid: int) -> int:
    """Anonymous executable mappings: XLA loads each program it compiles (or reads from the persistent cache) as
    code of its own, so a rise during the soak means a program compiled late."""
    with open(f"/proc/{pid}/maps") as f:
        return sum(1 for line in f if len(fields := line.split()) == 5 and fields[1] == "r-xp")


def shape_sweep(concurrency: int) -> list[tuple[float | None, int, range]]:
    """(temperature, concurrency, request indices) phases that make the servers compile every program the soak uses.

    A program is chosen per batch bucket and per length class of the batch's longest prompt (the prefill's token
    bucket, the decode's page-table width), so each level runs the shortest prompts alone (``i % 5 == 0``: two
    words, a decode batch within one page), the longest alone (``i % 5 == 4``) and the mix. Without the first, a
    decode batch of 8 or 16 short prompts only came together by chance, thousands of requests into the soak, and
    its compile grew the node by 3 to 6 MB (``docs/serving.md``)."""
    levels = [c for c in (1, 2, 4, 8, 16, 32, 64, 128) if c < concurrency] + [concurrency]
    phases = []
    for temperature in (0.0, 0.7, None):
        for c in levels:
            n = 8 * c
            phases += [(temperature, c, range(0, 5 * n, 5)), (temperature, c, range(4, 5 * n, 5)),
                       (temperature, c, range(n))]
    return phases


def warm_up(url: str, args, progress, console, failures: list) -> tuple[int, float]:
    """The shape sweep, then the soak's mix until ``--warmup`` requests and ``--warmup-s`` seconds; returns how many
    requests it sent, and the mix's requests per second."""
    sweep = shape_sweep(args.concurrency)
    task = progress.add_task("warm-up", total=sum(len(r) for *_, r in sweep) + args.warmup, rate="")
    advance = lambda: progress.advance(task)  # noqa: E731
    sent, started = 0, time.perf_counter()
    for temperature, level, indices in sweep:
        asyncio.run(drive(url, indices, level, advance, failures, temperature))
        sent += len(indices)
    mixed, mixed_started = 0, time.perf_counter()
    while mixed < args.warmup or time.perf_counter() - started < args.warmup_s:
        batch = max(args.warmup - mixed, 20 * args.concurrency)
        progress.update(task, total=sent + batch)
        asyncio.run(drive(url, range(sent, sent + batch), args.concurrency, advance, failures, rate=args.rate))
        sent, mixed = sent + batch, mixed + batch
        if not console.is_terminal:
            console.print(f"warm-up: {sent} requests, {time.perf_counter() - started:.0f} s")
    return sent, mixed / (time.perf_counter() - mixed_started)


async def soak(url: str, first: int, args, progress, failures: list, children, samples: list) -> float:
    """The measured part; the progress line shows the request rate and each node's RSS as it goes."""
    task = progress.add_task("soak", total=args.requests, rate="")
    started = time.perf_counter()

    async def show():
        while True:
            await asyncio.sleep(SAMPLE_EVERY_S)
            done = progress.tasks[task].completed
            rate = done / max(1e-9, time.perf_counter() - started)
            rss = {c.name: rss_kb(c.proc.pid) for c in children}
            samples.append({"requests": int(done), **rss})
            save_smaps(args.smaps, children, int(done))
            text = " ".join(f"{name}={kb / 1024:.1f}M" for name, kb in rss.items())
            progress.update(task, rate=f"{rate:5.0f}/s  RSS {text}")
            if not progress.console.is_terminal:  # no live bar in a log: a line per sample
                progress.console.print(f"soak: {done:.0f}/{args.requests}  {rate:.0f}/s  RSS {text}")

    shower = asyncio.ensure_future(show())
    try:
        await drive(url, range(first, first + args.requests), args.concurrency, lambda: progress.advance(task),
                    failures, rate=args.rate)
    finally:
        shower.cancel()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20_000, help="requests after warm-up (default 20000)")
    parser.add_argument("--warmup", type=int, default=12_000,
                        help="mixed requests before the first RSS reading (default 12000)")
    parser.add_argument("--warmup-s", type=float, default=90.0,
                        help="and at least this many seconds of warm-up (longer than the 60 s windows; default 90)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rate", type=float, default=50.0,
                        help="requests per second at most, in the mixed warm-up and the soak alike (default 50; "
                             "0: as fast as --concurrency allows)")
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--decode", type=int, default=1)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--transfer-backend", default="tcp")
    parser.add_argument("--journal-dir", default=None, help="journals and logs (default: a temporary directory)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON on stdout")
    parser.add_argument("--smaps", type=Path, default=None, metavar="DIR",
                        help="save each child's smaps at warm-up end and every sample (diff: bench/smaps.py)")
    args = parser.parse_args(argv)
    if args.smaps is not None:
        args.smaps.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True)
    failures: list[tuple[int, str]] = []
    samples: list[dict] = []

    with tempfile.TemporaryDirectory(prefix="fsm-pd-soak-") as tmp:
        journal_dir = Path(args.journal_dir or tmp)
        journal_dir.mkdir(parents=True, exist_ok=True)
        children = plan(args.prefill, args.decode, free_port(), args.model, args.transfer_backend, journal_dir,
                        ["--log-level", "warning"], router_extra=["--pd-policy=always"])  # its short prompts cross
        env = {**os.environ, **secret_env(generate_secret())}
        try:
            for child in children:
                console.print(f"starting {child.name} ({child.url})")
                log = open(child.log, "w")  # noqa: SIM115 - the child keeps writing to it
                child.proc = subprocess.Popen(child.argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                              stdin=subprocess.DEVNULL)
                wait_healthy(child, time.time() + HEALTH_TIMEOUT_S)
            url = children[-1].url
            columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                       TextColumn("{task.fields[rate]}"), TimeRemainingColumn())
            with Progress(*columns, console=console) as progress:
                warmed, warm_rate = warm_up(url, args, progress, console, failures)
                warm = {c.name: rss_kb(c.proc.pid) for c in children}
                warm_code = {c.name: code_maps(c.proc.pid) for c in children}
                save_smaps(args.smaps, children, 0)
                elapsed = asyncio.run(soak(url, warmed, args, progress, failures, children, samples))
            end = {c.name: rss_kb(c.proc.pid) for c in children}
            late_code = {c.name: code_maps(c.proc.pid) - warm_code[c.name] for c in children}
            save_smaps(args.smaps, children, args.requests)
        finally:
            stop(children)

    figures = {name: {"rss_warm_kb": warm[name], "rss_end_kb": end[name],
                      "kb_per_request": round((end[name] - warm[name]) / max(1, args.requests), 4),
                      "code_maps_added": late_code[name]}
               for name in warm}
    result = {"requests": args.requests, "warmup": warmed, "concurrency": args.concurrency,
              "failed": len(failures), "seconds": round(elapsed, 1),
              "requests_per_s": round(args.requests / elapsed, 1), "rate": args.rate,
              "warmup_requests_per_s": round(warm_rate, 1), "nodes": figures, "samples": samples}
    for i, problem in failures[:5]:
        console.print(f"[red]request {i} failed: {problem}[/]")
    if args.json:
        print(json.dumps(result, indent=2))
    console.print(f"{args.requests} requests after {warmed} warm-up, concurrency {args.concurrency}: "
                  f"{len(failures)} failed, {result['requests_per_s']} requests/s "
                  f"(warm-up mix {result['warmup_requests_per_s']}/s, --rate {args.rate:g})")
    for name, f in figures.items():
        console.print(f"  {name:10s} RSS {f['rss_warm_kb'] / 1024:8.1f} MiB -> {f['rss_end_kb'] / 1024:8.1f} MiB"
                      f"   {f['kb_per_request']:+.4f} KB/request"
                      + (f"   ({f['code_maps_added']} code mappings added: a program compiled late)"
                         if f["code_maps_added"] else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
