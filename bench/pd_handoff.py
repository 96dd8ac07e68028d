"""One ``--role pd`` handoff's ``xfer``, as replay reads it from the process's journals (issue 48: <= 0.5 ms).

A real ``fsm-pd serve --role pd --pd-policy always`` process (pool backend, tiny model unless --model) on a unix
socket, sent one streamless ``/generate`` at a time (one stream, greedy, 2 new tokens) of each --sizes prompt length,
random token ids, so every request is a handoff and nothing waits behind another. The process is stopped and
``fsm-pd replay --format json`` reads its journals: per prompt size, the time each side spent in Transferring (P's
is the whole handoff, its ``kv_ready`` to D's PULLED; D's its ``kv_published`` to its Success), p50 and p90 over
the rooms after each size's first --warmup.

A baseline in the same run: --baseline TREE (a checkout, say a worktree of the commit before) starts the same
command with ``PYTHONPATH=TREE``, alternated with this tree's starts --rounds times, so both see the same noise;
the table gives each tree's medians over its rounds and the ratio this/baseline. With --trace, each start also
writes the gaps between a handoff's rows (P kv_ready -> published -> D kv_published -> pulled -> scattered -> P
pull_done), medians in ms, read from the same journals.

    python bench/pd_handoff.py [--baseline /work/wt-base] [--rounds 2] [--requests 60] [--sizes 16,1024]
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
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_targets import Target, start, stop, wait_background, wait_health  # noqa: E402 - beside this script

from fsm_pd.net import unix_http  # noqa: E402
from fsm_pd.net.unix_sockets import unix_address  # noqa: E402

HERE_TREE = Path(__file__).resolve().parent.parent
PAGE_TOKENS = 16  # the tiny model's page on a CPU: a prompt's size is read back from its page count
HOPS = (("prefill", "kv_ready"), ("prefill", "published"), ("decode", "kv_published"), ("decode", "pulled"),
        ("decode", "scattered"), ("prefill", "pull_done"))


def serve(tree: Path, run_dir: Path, model: str, name: str) -> Target:
    sock = run_dir / f"{name}.sock"
    argv = [sys.executable, "-m", "fsm_pd.cli", "serve", "--role", "pd", "--pd-policy", "always", "--model", model,
            "--uds", str(sock), "--journal-dir", str(run_dir / f"{name}-journals")]
    t = Target(name, argv, unix_http.http_url(unix_address(str(sock))), run_dir / f"{name}.log")
    start(t, env={**os.environ, "PYTHONPATH": str(tree)})
    return t


def send(url: str, sizes: list[int], requests: int, vocab: int, seed: int) -> None:
    rng = random.Random(seed)
    with unix_http.client(timeout=httpx.Timeout(120, connect=10)) as http:
        for _ in range(requests):
            for size in sizes:
                body = {"input_ids": [rng.randrange(1, vocab) for _ in range(size)],
                        "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}}
                http.post(url + "/generate", json=body).raise_for_status()


def handoffs(journal_dir: Path, sizes: list[int], warmup: int) -> dict:
    """Per size: P's and D's xfer (ms, p50 and p90) and the median gap of each hop, from replay's JSON."""
    files = sorted(str(f) for f in journal_dir.glob("*.db"))
    out = subprocess.run([sys.executable, "-m", "fsm_pd.cli", "replay", *files, "--format", "json"],
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"replay exited {out.returncode}: {out.stderr[-500:]}")
    rooms: dict[int, dict[str, dict]] = {}
    for side in json.loads(out.stdout)["rooms"]:
        rooms.setdefault(side["room"], {})[side["role"]] = side
    by_pages = {-(-size // PAGE_TOKENS): size for size in sizes}
    found: dict[int, list[dict]] = {size: [] for size in sizes}
    for room in rooms.values():
        if {s["final"] for s in room.values()} != {"Success"} or len(room) != 2:
            raise RuntimeError(f"a room did not succeed on both sides: {room}")
        size = by_pages.get(room["prefill"]["pages"]["pages"])
        if size is not None:
            found[size].append(room)
    report = {}
    for size, sides in found.items():
        sides = sorted(sides, key=lambda r: r["prefill"]["started_at"])[warmup:]
        figures: dict = {"n": len(sides)}
        for role in ("prefill", "decode"):
            xfer = sorted(1000 * r[role]["time_in_state"]["Transferring"] for r in sides)
            figures[role] = {"p50": statistics.median(xfer), "p90": xfer[int(0.9 * (len(xfer) - 1))]}
        gaps = [[] for _ in HOPS[1:]]
        for r in sides:
            at = {(role, e["trigger"]): e["at"] for role in ("prefill", "decode") for e in r[role]["events"]}
            for i, (a, b) in enumerate(zip(HOPS, HOPS[1:], strict=False)):
                gaps[i].append(1000 * (at[b] - at[a]))
        figures["hops"] = [statistics.median(g) for g in gaps]
        report[size] = figures
    return report


def one_start(tree: Path, run_dir: Path, name: str, args: argparse.Namespace) -> dict:
    t = serve(tree, run_dir, args.model, name)
    try:
        wait_health(t, 300)
        wait_background(t, 300)  # nothing compiles while measured
        send(t.url, args.sizes, args.requests + args.warmup, args.vocab, seed=len(name))
    finally:
        rc = stop(t)
    if rc != 0:
        raise RuntimeError(f"{name} exited {rc}:\n{t.log_tail()}")
    return handoffs(run_dir / f"{name}-journals", args.sizes, args.warmup)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", type=Path, help="a checkout to compare with, started alternately in the same run")
    p.add_argument("--rounds", type=int, default=2, help="starts of each tree")
    p.add_argument("--requests", type=int, default=60, help="measured requests per size and start")
    p.add_argument("--warmup", type=int, default=5, help="requests per size and start not counted")
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[16, 1024])
    p.add_argument("--model", default="tiny")
    p.add_argument("--vocab", type=int, default=256, help="token ids are drawn below this")
    p.add_argument("--trace", action="store_true", help="print each start's hop gaps")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    trees = {"this": HERE_TREE} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    results: dict[str, list[dict]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory(prefix="pd-handoff-") as tmp:
        for round_ in range(args.rounds):
            for name, tree in (reversed(trees.items()) if round_ % 2 else trees.items()):
                report = one_start(tree, Path(tmp), f"{name}-{round_}", args)
                results[name].append(report)
                for size, f in report.items():
                    print(f"round {round_} {name:8} {size:5} tokens: P xfer p50 {f['prefill']['p50']:.3f} p90 "
                          f"{f['prefill']['p90']:.3f}  D xfer p50 {f['decode']['p50']:.3f} p90 "
                          f"{f['decode']['p90']:.3f} ms (n={f['n']})"
                          + (f"  hops {' / '.join(f'{g:.3f}' for g in f['hops'])}" if args.trace else ""),
                          file=sys.stderr, flush=True)
    print("\n| tree | prompt tokens | P xfer p50 / p90 (ms) | D xfer p50 / p90 (ms) |\n| --- | ---: | ---: | ---: |")
    med = {}
    for name, reports in results.items():
        for size in args.sizes:
            fig = {f"{role} {q}": statistics.median(r[size][role][q] for r in reports)
                   for role in ("prefill", "decode") for q in ("p50", "p90")}
            med[name, size] = fig
            print(f"| {name} | {size} | {fig['prefill p50']:.3f} / {fig['prefill p90']:.3f} | "
                  f"{fig['decode p50']:.3f} / {fig['decode p90']:.3f} |")
    if args.baseline:
        ratios = []
        for size in args.sizes:
            now, base = med["this", size], med["baseline", size]
            ratios.append(f"{size} tokens: P p50 {now['prefill p50'] / base['prefill p50']:.2f}x, "
                          f"D p50 {now['decode p50'] / base['decode p50']:.2f}x")
        print("\nthis / baseline (medians over rounds): " + "; ".join(ratios))
    if args.json:
        args.json.write_text(json.dumps({"results": results, "medians": {f"{n} {s}": v for (n, s), v in med.items()}},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
