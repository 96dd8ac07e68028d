"""Fleet failover figures: 2 prefill + 2 decode `fsm-pd serve` nodes (tiny model, tcp, 127.0.0.1) behind a router, 32
concurrent greedy requests of mixed kinds (/generate and chat, whole and streamed), through the phases of
tests/integration/test_fleet_failover.py: an undisturbed baseline, SIGKILL the busiest prefill node mid-load, SIGSTOP
the busiest decode node once half the streams have tokens out (SIGCONT after), SIGKILL the busiest decode node the
same way, kill the last prefill node.

Prints per phase: requests ok / failed, median and max seconds, outputs that differ from the undisturbed run, the
first errors; for the built-in router also its retry, migration, refusal and ejection counters. `--router sglang`
runs the real sglang-router 0.3.2 (`--pd-disaggregation`, its default retry and breaker settings) in front of the
same nodes instead, to see what it does.

    python bench/fleet_failover.py [--router builtin|sglang] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
from failover import metric, phases, start_fleet, summary  # noqa: E402 - the harness the test uses
from processes import Cluster  # noqa: E402

PHASES = (("baseline_short", None), ("baseline_long", None), ("prefill_kill", "baseline_short"),
          ("decode_stop", "baseline_long"), ("decode_kill", "baseline_long"), ("no_prefill", None))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--router", choices=("builtin", "sglang"), default="builtin")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    console = Console(stderr=True)
    with tempfile.TemporaryDirectory(prefix="fleet-failover-") as tmp:
        cluster = Cluster(Path(tmp))
        try:
            console.print(f"starting 2 prefill + 2 decode nodes and the {args.router} router (logs in {tmp})")
            router, prefills, decodes, procs = start_fleet(cluster, args.router)
            console.print("running the phases")
            found = phases(router, prefills, decodes, procs, warm_rounds=1)
            figures = {name: summary(found[name], found.get(base)) for name, base in PHASES}
            figures["load_at_kill"] = found["load_at_kill"]  # requests each node ran when its role's victim died
            if args.router == "builtin":
                figures["counters"] = {name: metric(router, f"fsm_pd_router_{name}_total") for name in (
                    "retries", "migrations", "failover_refused", "worker_ejections")}
        finally:
            cluster.stop()
    if args.json:
        print(json.dumps({"router": args.router, **figures}))
        return 0
    table = Table(title=f"fleet failover, {args.router} router, 32 concurrent requests per phase")
    for column in ("phase", "ok", "failed", "median s", "max s", "differ", "first errors"):
        table.add_column(column)
    for name, _ in PHASES:
        f = figures[name]
        table.add_row(name, str(f["ok"]), str(f["failed"]), f"{f['median_s']:.2f}", f"{f['max_s']:.2f}",
                      str(f.get("differ_from_baseline", "")), "\n".join(e[:100] for e in f["errors"][:2]))
    Console().print(table)
    print(json.dumps({"load_at_kill": figures["load_at_kill"], **figures.get("counters", {})}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
