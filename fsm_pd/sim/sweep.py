"""``python -m fsm_pd.sim --seeds 1-200 --fault-rate 0.2``: run many seeded worlds and check every invariant of each.

Per seed: ``schedule_requests`` (Poisson arrivals and the seeded faults: message fates, failed and corrupted pulls,
failed lookups, late reports, client aborts, crashes, a stall), run to idle (bounded: ``Stuck`` is a failure), then
the checks of the property suite that need no hypothesis: ownership and page lifetimes (the ledger, at every event),
no leaks and exact page accounting, every room within its deadlines and every state within its deadline plus the
slack (at every instant the world settled), both sides' outcomes agree or a recorded fault explains them, no
corrupted handoff reaches decode and replay names the checksum, the journals replay to the live state and every
journaled decision is the tables'. Prints one line per seed that failed and a summary; exits 1 if any did.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from fsm_pd.sim.bounds import Stuck
from fsm_pd.sim.invariants import (
    journal_disagreements,
    journal_rows,
    leaks,
    overdue_rooms,
    overdue_states,
    ownership_violations,
    page_accounting,
    table_disagreements,
)
from fsm_pd.sim.outcomes import corruption_served, outcome_disagreements
from fsm_pd.sim.run import schedule_requests
from fsm_pd.sim.world import SimConfig, World


def check_seed(config: SimConfig, journal_dir: Path) -> tuple[list[str], Counter]:
    """Run one world; returns its violations and what happened (outcomes, faults)."""
    world = World(config, journal_dir, durability="off")
    instant: list[str] = []
    world.probes.append(lambda: instant.extend(overdue_states(world)[:1]))
    try:
        schedule_requests(world)
        try:
            world.run()
        except Stuck as exc:
            return [*instant[:2], f"stuck: {exc}"], Counter()
        rows = journal_rows(world)
        found = (ownership_violations(world) + instant[:3] + overdue_rooms(world) + leaks(world)
                 + page_accounting(world) + outcome_disagreements(world) + corruption_served(world, rows)
                 + journal_disagreements(world, rows) + table_disagreements(world, rows))
        seen: Counter = Counter(f"fault {f.kind}" for f in world.fault_log)
        for slot in (world.decode,):
            if slot.alive:
                seen.update({f"decode loop {k}": v for k, v in slot.instance.scheduler.loop.counters().items()})
        seen["shared-pool worlds"] += world.shared_pool
        for (_node, role, _room), room in world.live_rooms().items():
            seen[f"{role} {room.state}"] += 1
            if room.reason and "checksum mismatch" in room.reason and role == "decode":
                seen["decode failed on the checksum"] += 1
            if role == "decode" and room.state == "Success" and room.ctx.get("adopted_pages"):
                seen["decode adopted the pages"] += 1
            if role == "decode" and room.reason and "freed or reused meanwhile" in room.reason:
                seen["decode's hand-over refused"] += 1
        return found, seen
    finally:
        world.close()


def seed_range(text: str) -> range:
    first, _, last = text.partition("-")
    try:
        lo, hi = int(first), int(last or first)
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds are N or N-M, got {text!r}") from None
    if hi < lo:
        raise argparse.ArgumentTypeError(f"empty seed range {text!r}")
    return range(lo, hi + 1)


DEFAULTS = SimConfig()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsm_pd.sim", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=seed_range, default=range(1, 21), help="N or N-M (default 1-20)")
    parser.add_argument("--fault-rate", type=float, default=0.2, help="0..1 (default 0.2)")
    parser.add_argument("--requests", type=int, default=100, help="requests per seed (default 100)")
    parser.add_argument("--decode-pages", type=int, default=DEFAULTS.num_pages,
                        help=f"the decode pool (default {DEFAULTS.num_pages}); a small one makes the decode loop "
                             "retract (e.g. 256 with --max-prompt 512 --decode-tokens 256)")
    parser.add_argument("--max-prompt", type=int, default=DEFAULTS.max_prompt, help="longest prompt, tokens")
    parser.add_argument("--decode-tokens", type=int, default=DEFAULTS.decode_tokens,
                        help="a request decodes 1 to this many tokens")
    parser.add_argument("--shared-pool", type=float, nargs="?", const=1.0, default=0.0, metavar="CHANCE",
                        help="the chance (alone: 1) that a seed runs both roles as --role pd on one set of devices: "
                             "one process, one pool of both pools' pages, handoffs that move page ownership")
    args = parser.parse_args(argv)
    if not 0.0 <= args.fault_rate <= 1.0:
        parser.error(f"--fault-rate must be between 0 and 1, got {args.fault_rate}")
    if not 0.0 <= args.shared_pool <= 1.0:
        parser.error(f"--shared-pool must be between 0 and 1, got {args.shared_pool}")
    started, failed, total = time.monotonic(), 0, Counter()
    work = Path(tempfile.mkdtemp(prefix="fsm-pd-sweep-"))
    try:
        for seed in args.seeds:
            journal_dir = work / str(seed)
            config = SimConfig(requests=args.requests, seed=seed, fault_rate=args.fault_rate,
                               num_pages=args.decode_pages, max_prompt=args.max_prompt,
                               decode_tokens=args.decode_tokens, shared_pool=args.shared_pool)
            found, seen = check_seed(config, journal_dir)
            shutil.rmtree(journal_dir, ignore_errors=True)
            total.update(seen)
            if found:
                failed += 1
                print(f"seed {seed}: {len(found)} violation(s): {found[:3]}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    seeds = len(args.seeds)
    print(f"{seeds - failed} of {seeds} seeds held every invariant at fault rate {args.fault_rate} "
          f"({args.requests} requests each), {time.monotonic() - started:.1f} s")
    print("  " + ", ".join(f"{key}: {value}" for key, value in sorted(total.items())))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
