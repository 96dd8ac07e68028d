"""What the node's metrics observer costs the node loop: events per second through ``Node.step`` with
``NodeMetrics`` attached (rooms by state, transitions, per-phase histograms, outcomes by reason class, and the
failed-room log line) against the same node without it, measured in the same run.

Each room is a prefill (sender) room through the real machine, from ``create`` to Success (``metadata_received``,
``kv_ready``, ``published``, ``pull_done``); ``--fail-every N`` makes every Nth room end Failed by an ``abort``
instead, so the failure path (reason class, JSON log line) is in the figure too. Effects are not run (a null
interpreter): what is left is deciding, journaling (``--journal none|sqlite``; SQLite with fsync per step) and
observing, so the ratio is the observer's share of the loop at its busiest. The log line goes to a null handler:
its JSON is built all the same.

    python bench/observability.py [--rooms 20000] [--in-flight 1000] [--repeats 5] [--journal none|sqlite]
                                  [--fail-every 10] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

from fsm_pd.control.metrics import NodeMetrics
from fsm_pd.effects import Node, VirtualClock
from fsm_pd.machines import SENDER
from fsm_pd.store import Journal

LAYOUT = {"num_layers": 2, "num_pages": 64, "page_size": 16, "kv_heads": 1, "head_dim": 8, "dtype": "float32"}
DEADLINES = {"bootstrap": 30.0, "waiting": 30.0, "pull_hold": 30.0}


class NullInterpreter:
    def run(self, node, room, decision) -> None:
        pass


def lifecycle(room: int, fail: bool) -> list[tuple[str, dict]]:
    events = [("metadata_received", {"peer": "d0", "peer_layout": LAYOUT}), ("kv_ready", {"pages": [1]})]
    if fail:
        return [*events, ("abort", {"reason": "aborted: its HTTP request was closed before it finished"})]
    return [*events, ("published", {}), ("pull_done", {"peer": "d0"})]


def run_once(rooms: int, in_flight: int, journal: str, fail_every: int, observed: bool, tmp: Path) -> float:
    """Events per second through ``Node.step`` for ``rooms`` lifecycles, ``in_flight`` rooms per batch."""
    store = Journal(tmp / f"j-{time.monotonic_ns()}.db") if journal == "sqlite" else None
    clock = VirtualClock()
    node = Node("p0", SENDER, store, NullInterpreter(), clock, DEADLINES)
    if observed:
        NodeMetrics(node)
    events = 0
    started = time.perf_counter()
    for first in range(0, rooms, in_flight):
        batch = range(first, min(first + in_flight, rooms))
        for room in batch:
            node.create(room, {"layout": LAYOUT, "prompt_len": 16})
        events += node.step()
        plans = {room: lifecycle(room, fail_every > 0 and room % fail_every == 0) for room in batch}
        for i in range(max(len(p) for p in plans.values())):
            for room, plan in plans.items():
                if i < len(plan):
                    clock.advance_to(clock.now() + 0.0001)
                    node.submit(room, *plan[i])
            events += node.step()
        for room in batch:
            node.clear(room)
    elapsed = time.perf_counter() - started
    if store is not None:
        store.close()
    return events / elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rooms", type=int, default=20000, help="room lifecycles per repeat (default 20000)")
    parser.add_argument("--in-flight", type=int, default=1000, help="rooms decided per node step (default 1000)")
    parser.add_argument("--repeats", type=int, default=5, help="repeats; medians are reported (default 5)")
    parser.add_argument("--journal", choices=("none", "sqlite"), default="none",
                        help="journal the rows to nothing or to a SQLite file with fsync per step (default none)")
    parser.add_argument("--fail-every", type=int, default=10, help="every Nth room ends Failed (0: none; default 10)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = parser.parse_args(argv)
    failed_log = logging.getLogger("fsm_pd.failed_room")
    failed_log.addHandler(logging.NullHandler())
    failed_log.propagate = False
    bare, observed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for flag, out in ((False, bare), (True, observed)):
                out.append(run_once(args.rooms, args.in_flight, args.journal, args.fail_every, flag, Path(tmp)))
            if not args.json:
                print(f"repeat {i + 1}/{args.repeats}: {bare[-1]:,.0f} events/s bare, {observed[-1]:,.0f} observed",
                      flush=True)
    result = {
        "rooms": args.rooms, "in_flight": args.in_flight, "journal": args.journal, "fail_every": args.fail_every,
        "repeats": args.repeats,
        "events_per_s_bare_median": statistics.median(bare),
        "events_per_s_observed_median": statistics.median(observed),
        "observed_over_bare": statistics.median(observed) / statistics.median(bare),
        "observer_us_per_event": 1e6 * (1 / statistics.median(observed) - 1 / statistics.median(bare)),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"node loop, {args.journal} journal: {result['events_per_s_bare_median']:,.0f} events/s without "
              f"metrics, {result['events_per_s_observed_median']:,.0f} with (x{result['observed_over_bare']:.2f}; "
              f"the observer costs {result['observer_us_per_event']:.1f} us per event; medians of {args.repeats})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
