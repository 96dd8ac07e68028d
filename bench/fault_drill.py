"""Fault drills on real processes, with figures: kill and restart each node under 32 concurrent mixed requests,
SIGSTOP each for 20 s, and bad input beside ordinary requests (the same drills as tests/integration/test_restarts.py).

Starts `fsm-pd serve` prefill (with its bootstrap server), decode and the built-in router itself (tiny model, tcp
backend, 4 s deadlines, 0.5 s heartbeat, 127.0.0.1) for each drill, and prints per drill: requests ok / error / hung /
silent, the requests in flight at the fault and how long they took to end, and the recovery times.

    python bench/fault_drill.py [--drills kill-prefill kill-decode stop-prefill stop-decode bad-input]
                                [--workers 32] [--stop-seconds 20] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

# The drills serve the tiny model, as the tests do (whose conftest sets this): without it a node serves smollm2
os.environ.setdefault("FSM_PD_MODEL", "tiny")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
from drills import bad_input, kill_and_restart, stop_and_continue  # noqa: E402 - the harness the tests use
from fault_rig import Rig  # noqa: E402

DRILLS = {
    "kill-prefill": lambda rig, a: kill_and_restart(rig, "prefill", workers=a.workers),
    "kill-decode": lambda rig, a: kill_and_restart(rig, "decode", workers=a.workers),
    "stop-prefill": lambda rig, a: stop_and_continue(rig, "prefill", seconds=a.stop_seconds, workers=a.workers),
    "stop-decode": lambda rig, a: stop_and_continue(rig, "decode", seconds=a.stop_seconds, workers=a.workers),
    "bad-input": lambda rig, a: bad_input(rig),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drills", nargs="+", choices=list(DRILLS), default=list(DRILLS))
    parser.add_argument("--workers", type=int, default=32, help="concurrent clients (default 32)")
    parser.add_argument("--stop-seconds", type=float, default=20.0, help="how long SIGSTOP lasts (default 20)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON lines")
    args = parser.parse_args()
    console = Console(stderr=True)
    results = []
    for name in args.drills:
        with tempfile.TemporaryDirectory(prefix="fsm-pd-drill-") as tmp:
            console.print(f"[bold]{name}[/bold]: starting prefill, decode and router ...")
            rig = Rig(Path(tmp))
            try:
                figures = DRILLS[name](rig, args)
            except AssertionError as err:
                figures = {"drill": name, "failed": str(err)[:500]}
            finally:
                rig.stop()
        results.append(figures)
        if args.json:
            print(json.dumps(figures))
        else:
            table = Table(title=figures["drill"])
            table.add_column("figure")
            table.add_column("value")
            for key, value in figures.items():
                if key != "drill":
                    table.add_row(key, json.dumps(value) if isinstance(value, dict) else str(value))
            Console().print(table)
    return 1 if any("failed" in f for f in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
